"""Our butterfly all-reduce on real hivemind P2P daemons (loopback), in one process.

Covers the semantics the swarm relies on: every member gets bit-identical, token-weighted averages;
a reducer that never shows up leaves its span missing (None) on every survivor instead of a
silently partial result; malformed metadata rejects the group.
"""

import asyncio
import threading
import time
from typing import AsyncIterator, Callable

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext

from helpers import p2p_mesh, run_async
from peer.config import MBIT
from peer.net.round.allreduce import run_allreduce
from peer.net.round.reducer import AllReduceServicer
from peer.net.flow.bandwidth import BURST_S, Bandwidth
from peer.net.flow.credit import SendWindow
from peer.net.flow.streams import StreamGuard, drain
from peer.net.round.group import PROTOCOL_VERSION, GroupError, GroupPlan, member_spans
from peer.net.trust.exclusion import Exclusions, Offence
from peer.net.trust.span_proofs import SpanSigner, span_digest
from peer.net.round.reduction import decode_piece, encode_pieces
from peer.outer.aggregate import AggregationRule, Aggregator
from peer.outer.codec import get_codec
from peer.proto import allreduce_pb2 as pb

NUMEL = 1000
BASE = "0" * 32  # a declared base digest (peer/net/policy/agreement.py): every member the same
KEY = bytes(32)  # a declared span key (peer/net/trust/span_proofs.py) for plans whose averages nobody signs


def test_member_spans_cover_exactly_and_skip_client_mode():
    spans = member_spans(1000, [False, True, False, False], align=64)
    assert spans[1] == (0, 0)
    covered = sorted(s for s in spans if s[1] > s[0])
    assert covered[0][0] == 0 and covered[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert all(start % 64 == 0 for start, _ in covered)
    with pytest.raises(GroupError):
        member_spans(10, [True, True], align=1)


def _group(peer_ids, weights, numel=NUMEL, caps=None, links=None, keys=None, clients=()):
    """``keys``: each member's span key (its servicer's ``signer.public``; default: keys nobody signs with);
    ``clients``: the indices of members in client mode."""
    caps = caps or [0.0] * len(weights)
    links = links or [0.0] * len(weights)
    keys = keys or [KEY] * len(weights)
    gathered = tuple(pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=w, numel=numel,
                                   download_bytes_per_second=cap, upload_bytes_per_second=up,
                                   span_key=key, client_mode=i in clients).SerializeToString()
                     for i, (w, cap, up, key) in enumerate(zip(weights, caps, links, keys)))
    return GroupInfo(b"g" * 20, tuple(peer_ids), gathered)


def test_group_plan_leaves_out_members_whose_info_is_bad_and_names_them():
    """A member one element off, of another protocol, with a bad weight or an unparsable info is left out of the
    plan by every member alike (named, for the exclusion ledger); the others reduce without it."""
    codec = get_codec("fp32")
    ids = ["a", "b", "c"]
    good = _group(ids, [1.0, 1.0, 1.0]).gathered
    bad_infos = {"numel": _group(["b"], [1.0], numel=NUMEL + 1).gathered[0],
                 "protocol": pb.MemberInfo(protocol_version=PROTOCOL_VERSION - 1, base=BASE, weight=1.0,
                                           numel=NUMEL).SerializeToString(),
                 "weight": _group(["b"], [float("nan")]).gathered[0],
                 "unparsable": b"\xff\xff\xff"}
    for what, blob in bad_infos.items():
        group = GroupInfo(b"g" * 20, tuple(ids), (good[0], blob, good[2]))
        plans = [GroupPlan.from_group(group, me, codec, NUMEL, "t") for me in ("a", "c")]
        for plan in plans:
            assert plan.peer_ids == ("a", "c") and len(plan.dropped) == 1 and plan.dropped[0][0] == "b", what
            assert what in plan.dropped[0][1] or what == "protocol" and "protocol" in plan.dropped[0][1]
        assert plans[0].spans == plans[1].spans and [p.my_index for p in plans] == [0, 1]
    with pytest.raises(GroupError, match="no other member"):  # nobody left to reduce with
        GroupPlan.from_group(GroupInfo(b"g" * 20, ("a", "b"), (good[0], b"")), "a", codec, NUMEL, "t")
    with pytest.raises(GroupError, match="our own member info"):  # (we are the odd one out)
        GroupPlan.from_group(_group(["a", "b"], [1.0, 1.0], numel=5), "a", codec, NUMEL, "t")
    with pytest.raises(GroupError, match="malformed group"):
        GroupPlan.from_group(GroupInfo(b"g", ("a", "b"), (good[0],)), "a", codec, NUMEL, "t")


async def _run(n_members, alive, weights, deltas, part_timeout=1.0, allreduce_timeout=4.0, rule=None, caps=None,
               numel=NUMEL, chunk_bytes=4096, uploads=None, links=None, span_sizing="equal", elsewhere=(), gone=(),
               identities=None, claims=None, clients=()):
    """One round of ``n_members`` on loopback; ``caps``: each member's download cap in bytes/s (0: none), declared
    in its MemberInfo and enforced by its download pacer; ``uploads``: each one's upload cap (its pacer only);
    ``links``: the uplinks they declare (MemberInfo.upload_bytes_per_second), ``span_sizing`` the run's;
    ``elsewhere``: members not in ``alive`` that serve (a live peer) but never learned of this group; ``gone``:
    members whose daemon is shut down before the round (killed as the group assembled); ``identities``: the members'
    identity files; ``claims(i, plan)``: member i's claims for the group (a ClaimBook; default none); ``clients``:
    members that declare client mode (no span)."""
    caps = caps or [0.0] * n_members
    uploads = uploads or [0.0] * n_members
    p2ps = await p2p_mesh(n_members, identities)
    try:
        ids = [p.peer_id for p in p2ps]
        signers = [SpanSigner() for _ in p2ps]
        group = _group(ids, weights, numel, caps, links, [s.public for s in signers], clients)
        servicers = []
        for i, p in enumerate(p2ps):
            s = AllReduceServicer(registration_timeout=1.0, part_timeout=part_timeout, stream_timeout=30.0,
                                  guard=StreamGuard(per_peer=16, total=64), signer=signers[i],
                                  bandwidth=Bandwidth(lambda up=uploads[i], cap=caps[i]: (up, cap)))
            if i in alive or i in elsewhere:  # a dead member registers no handler and sends nothing
                await s.add_p2p_handlers(p)
            servicers.append(s)
        plans = [GroupPlan.from_group(group, ids[i], get_codec("fp32"), numel, f"member {i}", rule,
                                      span_sizing=span_sizing) for i in range(n_members)]
        for i in gone:
            await p2ps[i].shutdown()

        async def member(i):
            t0 = time.monotonic()
            result = await run_allreduce(p2ps[i], servicers[i], plans[i], deltas[i], weights[i],
                                         part_timeout=part_timeout, allreduce_timeout=allreduce_timeout,
                                         connect_timeout=1.0, chunk_bytes=chunk_bytes,
                                         bandwidth=servicers[i].bandwidth,  # (one owner's caps, both sides)
                                         claims=None if claims is None else claims(i, plans[i]))
            result.seconds = time.monotonic() - t0  # (for the tests of caps)
            return result
        results = await asyncio.gather(*[member(i) for i in alive])
        return dict(zip(alive, results)), plans[0].spans
    finally:
        for p in p2ps:
            await p.shutdown()


def test_spans_follow_the_declared_links_within_bounds_and_cover_exactly():
    """swarm.span_sizing = "links": a reducer whose link is under half the group's median gets a span in proportion,
    down to 1/8 of an equal one; within half the median (timings wobble) and above it (a member that claims a huge
    uplink) an equal one; equal while any link is unknown; the spans cover the vector in blocks, in integer
    arithmetic."""
    from peer.net.round.group import MIN_SHARE, SHARE_UNIT, link_shares

    def infos(ups, downs=None):
        downs = downs or [0.0] * len(ups)
        return [pb.MemberInfo(upload_bytes_per_second=u, download_bytes_per_second=d) for u, d in zip(ups, downs)]

    assert link_shares(infos([1e6, 4e6, 4e6, 4e6])) == [4, 16, 16, 16]
    assert link_shares(infos([1e6, 1e6, 1e12])) == [SHARE_UNIT] * 3  # a liar gains nothing
    assert link_shares(infos([0.6e6, 1e6, 1e6, 3e6])) == [SHARE_UNIT] * 4  # within half the median: equal
    assert link_shares(infos([1.0, 1e6, 1e6])) == [MIN_SHARE, SHARE_UNIT, SHARE_UNIT]
    assert link_shares(infos([0.0, 1e6, 4e6])) == [SHARE_UNIT] * 3  # one not measured yet: equal
    assert link_shares(infos([4e6, 4e6, 4e6], [1e6, 0.0, 0.0])) == [4, 16, 16]  # a download cap below the uplink
    assert link_shares(infos([float("inf"), 1e6, 1e6])) == [SHARE_UNIT] * 3  # (not a link: unknown)
    spans = member_spans(1_000_000, [False, True, False, False, False], 64, [4, 99, 16, 16, 16])
    assert spans[1] == (0, 0)
    lengths = [e - s for s, e in spans if e > s]
    assert sorted(s for s, e in spans if e > s)[0] == 0 and max(e for _, e in spans) == 1_000_000
    assert all(s % 64 == 0 for s, _ in spans)
    assert abs(lengths[0] / lengths[1] - 4 / 16) < 0.01
    assert member_spans(1000, [False] * 3, 64, [16] * 3) == member_spans(1000, [False] * 3, 64)


def test_members_with_spans_that_follow_their_links_get_identical_weighted_average():
    torch.manual_seed(3)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    results, spans = run_async(_run(3, [0, 1, 2], weights, deltas, rule=AggregationRule(kind=Aggregator.MEAN),
                                    links=[1e6, 4e6, 4e6], span_sizing="links"))
    assert spans[0][1] - spans[0][0] < (spans[1][1] - spans[1][0]) / 2  # the slow link reduces the smallest span
    expected = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    got = [torch.cat([s.average for s in results[i].spans]) for i in range(3)]
    assert all(results[i].complete for i in range(3))
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])


def test_every_codec_pass_and_the_rule_run_off_the_event_loop(monkeypatch):
    """A round's encodes (our parts, our own part's round trip, the reducer's result), its decodes of the
    averages, the checks on them and the rule run on worker threads: over a fragment they take the CPU for
    seconds at scale, while the loop must keep reading streams and answering RPCs."""
    from peer.net.round import allreduce, reduction
    threads: dict[str, set[int]] = {}

    def recorded(name, fn):
        def call(*args, **kwargs):
            threads.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return call

    for module, name in ((allreduce, "encode_pieces"), (allreduce, "_through_codec"), (allreduce, "_check_spans"),
                         (allreduce, "_span_from_responses"), (reduction, "encode_pieces"), (reduction, "aggregate")):
        monkeypatch.setattr(module, name, recorded(f"{module.__name__}.{name}", getattr(module, name)))

    async def loop_thread():
        return threading.get_ident()

    torch.manual_seed(4)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    results, _ = run_async(_run(3, [0, 1, 2], [1.0, 1.0, 1.0], deltas))
    assert all(results[i].complete for i in range(3))
    assert len(threads) == 6, sorted(threads)  # every one of them ran
    loop = run_async(loop_thread())
    assert all(loop not in ran for ran in threads.values()), {k: loop in v for k, v in threads.items()}


def test_every_member_holds_every_valid_claim_the_client_mode_one_through_the_lists(tmp_path):
    """Each member sends its claim for the group with its parts, and each reducer relays the claims it holds with its
    list: the client-mode member, to which no part comes, holds every valid claim too. Member 1 signs with member 0's
    key (a claim that is not its word): no one holds one of member 1's, and the round itself is unaffected."""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net.plumbing.addresses import ensure_identity
    from peer.net.trust.auth import identity_key
    from peer.net.trust.claims import ClaimBook, ClaimSigner, statement

    paths = [str(tmp_path / f"id{i}") for i in range(4)]
    for path in paths:
        ensure_identity(path)
    keys: list[RSAPrivateKey] = [identity_key(path) for path in paths]
    signers = [ClaimSigner(keys[0] if i == 1 else key, "run") for i, key in enumerate(keys)]
    books = {}

    def claims(i, plan):
        stmt = statement("run", 0, 3, plan.group_id)
        books[i] = ClaimBook(stmt, plan.peer_ids, (plan.my_index, signers[i].claim((0, 3), stmt)))
        return books[i]

    torch.manual_seed(3)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    results, _ = run_async(_run(4, [0, 1, 2, 3], [1.0] * 4, deltas, identities=paths, claims=claims, clients=(3,)))
    assert all(r.complete and r.agreed for r in results.values())
    assert {i: sorted(book.held) for i, book in books.items()} == {i: [0, 2, 3] for i in range(4)}


def test_all_members_get_identical_weighted_average():
    torch.manual_seed(0)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]  # (5 > weight_cap x the lower median 2: the robust rule would cap it)
    results, spans = run_async(_run(3, [0, 1, 2], weights, deltas, rule=AggregationRule(kind=Aggregator.MEAN)))
    expected = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    for res in results.values():
        assert res.complete
        got = torch.cat([s.average for s in res.spans])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert res.contributors == [[0, 1, 2]] * 3
        assert res.traffic.sent > 0 and res.traffic.received > 0
    a, b, c = (torch.cat([s.average for s in results[i].spans]) for i in range(3))
    assert torch.equal(a, b) and torch.equal(b, c)  # bit-identical, not just close


def test_a_download_cap_holds_across_the_senders_by_credit_and_the_round_agrees(monkeypatch):
    """Member 2 of 3 declares a 8 Mbit/s download cap: the two parts of its span and the two averages it fetches
    (1.6 MB in 64 KiB messages) come in no faster than the cap (a lower bound: a loaded machine only makes it
    slower), with credit flowing both ways on its streams (peer/net/flow/credit.py), while the uncapped members are
    not held to it; every member gets the same bits."""
    numel, cap = 400_000, 8 * MBIT
    torch.manual_seed(5)
    deltas = [torch.randn(numel) for _ in range(3)]
    windows = []  # every sender's window, with the credits it was granted (the receiver's pacer alone would also
    init, grant = SendWindow.__init__, SendWindow.grant  # hold the lower bound below: this shows the credit)

    def spy_init(self, size):
        init(self, size)
        self.granted = 0
        windows.append(self)

    def spy_grant(self, acknowledged):
        grant(self, acknowledged)
        self.granted += 1
    monkeypatch.setattr(SendWindow, "__init__", spy_init)
    monkeypatch.setattr(SendWindow, "grant", spy_grant)
    results, _ = run_async(_run(3, [0, 1, 2], [1.0, 1.0, 1.0], deltas, part_timeout=30.0, allreduce_timeout=60.0,
                                rule=AggregationRule(kind=Aggregator.MEAN), caps=[0.0, 0.0, cap], numel=numel,
                                chunk_bytes=64 * 1024))
    got = [torch.cat([s.average for s in results[i].spans]) for i in range(3)]
    assert all(results[i].complete for i in range(3))
    assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])
    torch.testing.assert_close(got[0], sum(deltas) / 3)
    capped = results[2].traffic.received
    assert capped > 4 * 4 * numel / 3  # two parts in, two averages in (fp32)
    assert results[2].seconds >= capped / cap - BURST_S, (results[2].seconds, capped / cap)
    # streams to member 2: two parts (from 0, 1) and two averages (from reducers 0, 1) ran on granted credit;
    # the eight streams to the uncapped members had no window and no credit
    credited = [w for w in windows if w.size]
    assert len(credited) == 4 and all(w.granted > 0 for w in credited), [(w.size, w.granted) for w in windows]
    assert all(w.granted == 0 for w in windows if not w.size)


def test_a_member_whose_stream_breaks_off_is_not_waited_for():
    """Member 2 dies mid-round: it sends the first piece of its part to reducers 0 and 1, and its streams end
    there (it reduces nothing: no handler). The reducers stop waiting for it as soon as its streams end, not
    after part_timeout (30 s here), so the survivors end the round together and early; they average without it."""
    numel, part_timeout = 4000, 30.0
    torch.manual_seed(6)
    deltas = [torch.randn(numel) for _ in range(3)]

    async def main():
        p2ps = await p2p_mesh(3)
        try:
            ids = [p.peer_id for p in p2ps]
            signers = [SpanSigner() for _ in range(2)]
            group = _group(ids, [1.0] * 3, numel, keys=[*(s.public for s in signers), KEY])
            plans = [GroupPlan.from_group(group, ids[i], get_codec("fp32"), numel, f"member {i}") for i in range(3)]
            servicers = [AllReduceServicer(registration_timeout=1.0, part_timeout=part_timeout, stream_timeout=60.0,
                                           guard=StreamGuard(per_peer=16, total=64), signer=signer)
                         for signer in signers]
            for s, p in zip(servicers, p2ps):
                await s.add_p2p_handlers(p)

            async def broken_part(j):  # the first piece of member 2's part of span j, then the stream ends
                start, end = plans[2].spans[j]
                first = pb.ReduceRequest(group_id=plans[2].group_id, span_index=j, weight=1.0, offset=0,
                                         piece=get_codec("fp32").encode_flat(deltas[2][start:start + 256]))

                async def one():
                    yield first
                stream = await AllReduceServicer.get_stub(p2ps[2], ids[j]).rpc_reduce(one())
                return [msg async for msg in stream]

            t0 = time.monotonic()
            results = await asyncio.gather(*[
                run_allreduce(p2ps[i], servicers[i], plans[i], deltas[i], 1.0, part_timeout=part_timeout,
                              allreduce_timeout=60.0, connect_timeout=1.0, chunk_bytes=1024) for i in range(2)],
                broken_part(0), broken_part(1))
            return results[:2], plans[0].spans, time.monotonic() - t0
        finally:
            for p in p2ps:
                await p.shutdown()

    results, spans, seconds = run_async(main())
    assert seconds < part_timeout / 2, seconds  # not waited for until part_timeout
    for res in results:
        assert [bool(c) for c in res.contributors] == [True, True, False]  # span 2: its reducer is gone
        for j in (0, 1):
            start, end = spans[j]
            assert res.contributors[j] == [0, 1]
            torch.testing.assert_close(res.spans[j].average, ((deltas[0] + deltas[1]) / 2)[start:end])
    assert torch.equal(results[0].spans[0].average, results[1].spans[0].average)


def test_dead_reducer_span_is_missing_on_every_survivor():
    torch.manual_seed(1)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    weights = [1.0, 1.0, 1.0]
    results, spans = run_async(_run(3, [0, 1], weights, deltas))
    expected_live = (deltas[0] + deltas[1]) / 2  # the dead member's part never arrived
    for i, res in results.items():
        assert not res.complete and res.agreed  # (two of three spans, and each list says so: they are applied)
        assert res.spans[2].average is None  # its own span: missing, not applied
        for j in (0, 1):
            s = res.spans[j]
            torch.testing.assert_close(s.average, expected_live[s.start:s.end])
            assert res.contributors[j] == [0, 1]
    for j in (0, 1):
        assert torch.equal(results[0].spans[j].average, results[1].spans[j].average)
    # what each survivor concluded of the reducers, returned for its swarm to apply (nothing written here): the
    # other survivor answered; the dead one, which refused the stream at once while the other's span came, stayed
    # silent (no offence: once is nothing, and a dead peer is in no later group of ours)
    answered = {i: [v.peer for v in res.verdicts if v.answered] for i, res in results.items()}
    silent = {i: [v.peer for v in res.verdicts if not v.answered] for i, res in results.items()}
    assert all(v.offence is None for res in results.values() for v in res.verdicts)
    assert all(len(answered[i]) == len(silent[i]) == 1 for i in (0, 1)), (answered, silent)
    assert answered[0] != answered[1] and silent[0] == silent[1]  # each names the other, both the dead one
    assert silent[0][0] not in answered[0] + answered[1]


def test_a_member_that_never_learned_of_the_group_is_not_waited_for():
    """hivemind's matchmaking can list a member that had left (see test_matchmaking): it is alive and answers, but
    says it does not know the group. Its part will not come: the others' spans end at that answer (after its
    registration_timeout, 1 s here), not at part_timeout, with the same averages on both."""
    torch.manual_seed(2)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    results, _ = run_async(_run(3, [0, 1], [1.0, 1.0, 1.0], deltas, part_timeout=20.0, allreduce_timeout=30.0,
                                elsewhere=(2,)))
    _two_survivors_end_early_and_agree(results, deltas)


def _two_survivors_end_early_and_agree(results, deltas) -> None:
    """Members 0 and 1 ended well before part_timeout (20 s), without member 2's span, with the same average of
    their own two parts on both."""
    expected_live = (deltas[0] + deltas[1]) / 2
    for res in results.values():
        assert res.spans[2].average is None and res.seconds < 10.0, res.seconds  # (part_timeout: 20 s)
        for j in (0, 1):
            torch.testing.assert_close(res.spans[j].average, expected_live[res.spans[j].start:res.spans[j].end])
            assert res.contributors[j] == [0, 1]
    for j in (0, 1):
        assert torch.equal(results[0].spans[j].average, results[1].spans[j].average)


def test_a_member_whose_daemon_is_gone_is_not_waited_for():
    """A member killed as its group assembled: nobody can dial it (its daemon is gone), so its part will not come,
    and the others' spans end then, not at part_timeout (20 s here), with the same averages on both."""
    torch.manual_seed(3)
    deltas = [torch.randn(NUMEL) for _ in range(3)]
    results, _ = run_async(_run(3, [0, 1], [1.0, 1.0, 1.0], deltas, part_timeout=20.0, allreduce_timeout=30.0,
                                gone=(2,)))
    _two_survivors_end_early_and_agree(results, deltas)


def test_a_member_that_scales_its_part_and_lies_about_its_weight_is_bounded_and_named():
    """Issue 13's first attack, in one group of 4: member 3 multiplies its outer gradient by 1000 and declares
    10^6 times its tokens. With the plain mean every member applies the attacker's vector; with the robust
    rule (the default) every member gets a result closer to the honest mean than the farthest honest part is
    (the attacker does less than an honest peer's own noise), still bit-identical, and every reducer names the
    attacker (its peer id) among the contributions it limited."""
    g = torch.Generator().manual_seed(3)
    common = torch.randn(NUMEL, generator=g)
    honest = [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(3)]
    deltas, weights = honest + [1000 * honest[0]], [1.0, 1.0, 1.0, 1e6]
    clean = sum(honest) / 3
    spread = max(float(torch.linalg.vector_norm(h - clean) / torch.linalg.vector_norm(clean)) for h in honest)
    for rule, worst in ((AggregationRule(kind=Aggregator.MEAN), None), (AggregationRule(), spread)):
        results, _ = run_async(_run(4, [0, 1, 2, 3], weights, deltas, rule=rule))
        got = [torch.cat([s.average for s in results[i].spans]) for i in range(3)]
        assert torch.equal(got[0], got[1]) and torch.equal(got[1], got[2])
        error = float(torch.linalg.vector_norm(got[0] - clean) / torch.linalg.vector_norm(clean))
        if worst is None:
            assert error > 100, error  # the poisoned average (the issue: loss 2.49 -> 200,000)
            assert not any(res.flagged for res in results.values())
        else:
            assert error < worst, error
            attacker = str(results[0].flagged[0][0]) if results[0].flagged else "none"
            for i in range(3):  # each honest reducer limited the attacker's part of its own span
                assert [p for p, _ in results[i].flagged] == [attacker]
                # (its part points the honest way, x1000: its length is what the rule cuts, besides its weight)
                assert "weight 1e+06 capped" in results[i].flagged[0][1]
                assert "length capped" in results[i].flagged[0][1]


async def _err(self, requests: AsyncIterator[pb.ReduceRequest], context: P2PContext
               ) -> AsyncIterator[pb.ReduceResponse]:
    yield pb.ReduceResponse(status=pb.ReduceResponse.Status.REJECTED, error="busy, try later")
    await drain(requests, 5.0)  # (held until the member closes, as an honest refusal is: the answer arrives)


async def _hang_up(self, requests: AsyncIterator[pb.ReduceRequest], context: P2PContext
                   ) -> AsyncIterator[pb.ReduceResponse]:
    return
    yield  # (an async generator that closes the stream at once, without a word)


# Modified clients' reducers: one answers every member's part of its span with an error, one closes every stream
# at once (both still send their own parts, as an honest member does). Named as the honest class is: hivemind
# names a protocol after its class.
_ErringServicer = type("AllReduceServicer", (AllReduceServicer,), {"rpc_reduce": _err})
_HangingUpServicer = type("AllReduceServicer", (AllReduceServicer,), {"rpc_reduce": _hang_up})


def _rounds(n_rounds: int, deltas, weights, servicer_of=lambda i: AllReduceServicer, connect_timeout: float = 1.0,
            allreduce_timeout: float = 4.0):
    """``n_rounds`` rounds of one group of ``len(deltas)`` members on loopback (fp32), each member's exclusion ledger
    written from its verdicts after each round, as its swarm does; ``servicer_of(i)``: member i's servicer class.
    Returns the ids, the ledgers, every round's results and every round's seconds (until its last member ended)."""
    n = len(deltas)

    async def main():
        p2ps = await p2p_mesh(n)
        try:
            ids = [p.peer_id for p in p2ps]
            ledgers = [Exclusions() for _ in p2ps]
            servicers = [servicer_of(i)(registration_timeout=1.0, part_timeout=1.0, stream_timeout=30.0,
                                        guard=StreamGuard(per_peer=16, total=64), excluded=ledger)
                         for i, ledger in enumerate(ledgers)]
            for s, p in zip(servicers, p2ps):
                await s.add_p2p_handlers(p)
            rounds, seconds = [], []
            for r in range(n_rounds):
                began = time.monotonic()
                gathered = tuple(pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=w, numel=NUMEL,
                                               span_key=s.signer.public).SerializeToString()
                                 for w, s in zip(weights, servicers))
                group = GroupInfo(bytes([r + 1]) * 20, tuple(ids), gathered)
                plans = [GroupPlan.from_group(group, ids[i], get_codec("fp32"), NUMEL, f"fragment 0 round {r}")
                         for i in range(n)]
                rounds.append(await asyncio.gather(*[
                    run_allreduce(p2ps[i], servicers[i], plans[i], deltas[i], weights[i], part_timeout=1.0,
                                  allreduce_timeout=allreduce_timeout, connect_timeout=connect_timeout,
                                  chunk_bytes=4096) for i in range(n)]))
                seconds.append(time.monotonic() - began)
                for ledger, result in zip(ledgers, rounds[-1]):
                    for verdict in result.verdicts:
                        ledger.apply(verdict)
            return ids, ledgers, rounds, seconds
        finally:
            for p in p2ps:
                await p.shutdown()

    return run_async(main())


def _silent_reducer_rounds(servicer: type) -> list[str]:
    """Three rounds of one group of 4 whose member 3 serves ``servicer``: checks that its span is missing in each
    round, and that every honest member still applies the other three (every list agrees they came: once, such a
    round applied nothing, and the three rounds before the exclusion cost a short run 8-10% of its loss, bench/
    swarm_attacks.py), with the same spans on each; that each round ends long before its deadline
    (30 s here; each ends when every span is in or given up, about part_timeout, 1 s); that the attacker's is the
    only silent verdict of each honest member (no honest reducer is judged silent); and that three rounds in a row
    exclude it on every honest member (threshold 3) as silent, not as an offence. Returns the silent verdicts'
    reasons."""
    torch.manual_seed(5)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    ids, ledgers, rounds, seconds = _rounds(3, deltas, [1.0] * 4, connect_timeout=20.0, allreduce_timeout=30.0,
                                            servicer_of=lambda i: servicer if i == 3 else AllReduceServicer)
    attacker, whys = str(ids[3]), []
    for results, took in zip(rounds, seconds):
        assert took < 15.0, seconds  # (held to the deadline, a round took 30 s)
        for i in range(3):
            assert results[i].spans[3].average is None and not results[i].complete and results[i].agreed
            assert all(results[i].spans[j].average is not None for j in range(3))
            assert torch.equal(results[i].spans[0].average, results[0].spans[0].average)
            silent = [v for v in results[i].verdicts if not v.answered]
            assert [v.peer for v in silent] == [attacker], results[i].verdicts
            whys.append(silent[0].why)
    for i in range(3):
        assert set(ledgers[i].excluded()) == {attacker}, ledgers[i].excluded()
        assert "did not come in 3 rounds in a row" in ledgers[i].excluded()[attacker]
        assert ledgers[i].offences(attacker) == 0  # silence, not an offence
    return whys


def test_a_reducer_that_answers_every_part_with_an_error_is_excluded_after_three_rounds():
    """A modified client that answers every part of its span with an error (and sends its own parts). Counted as
    nothing, it was never excluded and stalled every round it was in (bench/swarm_attacks.py: every round
    ``partial``, 0 of 5 spans applied, for a whole run). Its answer is silence while the other reducers answer
    (:func:`_silent_reducer_rounds`), and each honest member read its answer: not a broken handler, not a
    timeout of ours."""
    whys = _silent_reducer_rounds(_ErringServicer)
    assert all(why.endswith(": busy, try later") for why in whys), whys


def test_a_reducer_that_hangs_up_at_once_does_not_hold_a_round_to_its_deadline():
    """A modified client that closes every stream to its span at once, without a word. A member's requests end
    only once the average is in, and hivemind's stream ends its responses only after its requests: each member
    waited the whole round's deadline (30 s here) for an answer that could not come. Its span now ends when the
    stream does, and it is silent and excluded as the erring reducer is (:func:`_silent_reducer_rounds`)."""
    whys = _silent_reducer_rounds(_HangingUpServicer)
    assert all(why.endswith(": no response") for why in whys), whys


def _other_face(factor: float, to: Callable[[int], bool]) -> type:
    """A modified client's reducer whose _send_average sends the members ``to`` selects (by index) its average
    x ``factor``, encoded anew and signed; the others its honest one."""

    async def send_average(self, red, member, requests, deadline, timing):
        honest = await asyncio.shield(red.result)
        if to(member) and honest[0].status == pb.ReduceResponse.Status.OK:
            average, filled = torch.empty(red.length), 0
            for msg in honest:
                filled += decode_piece(red.plan.codec, msg.piece, msg.offset, filled, average)
            other = [pb.ReduceResponse(offset=off, piece=piece)
                     for off, piece in encode_pieces(red.plan.codec, average * factor, red.chunk_elems)]
            other[0].contributors.extend(honest[0].contributors)
            other[0].total_weight = honest[0].total_weight
            gid, j = red.plan.group_id, red.plan.my_index
            other[0].signature = self.signer.sign(gid, j, span_digest(gid, j, other))
            red = _OtherFace(red, other)
        async for response in AllReduceServicer._send_average(self, red, member, requests, deadline, timing):
            yield response

    return type("AllReduceServicer", (AllReduceServicer,), {"_send_average": send_average})


class _OtherFace:
    """A reduction whose result, for one member, is another average."""

    def __init__(self, red, responses):
        self._red, self.result = red, asyncio.get_running_loop().create_future()
        self.result.set_result(responses)

    def __getattr__(self, name):
        return getattr(self._red, name)


_TwoFacedServicer = _other_face(1.02, lambda member: member % 2 == 1)


def test_a_reducer_that_sends_two_versions_of_its_average_is_caught_and_nobody_applies_them():
    """A modified client's reducer (member 3 of 4) sends its honest average to members 0 and 2 and another,
    plausible one (x1.02, signed as well) to member 1: each member's own checks pass, and before, the members that
    applied the round held two digests after it (bench/swarm_attacks.py two_faced_reducer: 18 of 38 rounds). Each
    reducer now sends every member what it received of every span: every honest member finds the other version
    among its partners' lists with the attacker's signature, applies nothing, and excludes the attacker at once on
    that proof; the next round the attacker's span is refused (missing) and the three others are applied."""
    torch.manual_seed(7)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    ids, ledgers, rounds, _ = _rounds(2, deltas, [1.0] * 4,
                                      servicer_of=lambda i: _TwoFacedServicer if i == 3 else AllReduceServicer)
    attacker = str(ids[3])
    for i in range(3):
        first = rounds[0][i]
        assert not first.complete and not first.agreed and first.spans[3].average is None
        assert all(first.spans[j].average is not None for j in range(3))
        proofs = [v for v in first.verdicts if v.offence == Offence.EQUIVOCATION]
        assert [v.peer for v in proofs] == [attacker] and "two digests of span 3" in proofs[0].why, first.verdicts
        assert not [v for v in first.verdicts if v.offence is not None and v.peer != attacker]
        assert attacker in ledgers[i].excluded() and ledgers[i].offences(attacker) == 1
        assert not rounds[1][i].complete and rounds[1][i].spans[3].average is None  # refused, not applied
        assert rounds[1][i].agreed  # (the others: every list lacks span 3)


def test_a_reducer_whose_average_fails_the_checks_costs_its_span_only():
    """A modified client's reducer (member 3 of 4) sends every member its average x1000, signed. Each honest member's
    size check refuses it and names it (an offence), and its list says it does not hold span 3, so all three apply
    the other three spans, the same on each. Before, such a round applied nothing anywhere: the rounds until the
    exclusion cost a short run 7-10% of its loss (bench/swarm_attacks.py lying_reducer)."""
    torch.manual_seed(8)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    ids, _, rounds, _ = _rounds(1, deltas, [1.0] * 4, servicer_of=lambda i: _other_face(1000.0, lambda m: True)
                                if i == 3 else AllReduceServicer)
    for i in range(3):
        res = rounds[0][i]
        assert res.agreed and res.spans[3].average is None and not res.complete
        assert all(torch.equal(res.spans[j].average, rounds[0][0].spans[j].average) for j in range(3))
        named = [v for v in res.verdicts if v.offence is not None]
        assert [(v.peer, v.offence) for v in named] == [(str(ids[3]), Offence.BAD_AVERAGE)], res.verdicts


def test_a_reducer_that_lies_to_one_member_costs_that_member_only():
    """The same reducer sends its average x1000 to member 1 only. Member 1 refuses it, and its list says so: the
    others hold every span and apply them all (one list of four lacks span 3: nobody can apply without it), while
    member 1 applies nothing (the others' lists hold a span it lacks)."""
    torch.manual_seed(9)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    _, _, rounds, _ = _rounds(1, deltas, [1.0] * 4, servicer_of=lambda i: _other_face(1000.0, lambda m: m == 1)
                              if i == 3 else AllReduceServicer)
    results = rounds[0]
    assert results[1].spans[3].average is None and not results[1].agreed
    for i in (0, 2):
        assert results[i].complete and results[i].agreed
        assert all(torch.equal(a.average, b.average) for a, b in zip(results[i].spans, results[0].spans))


async def _hold(self, red, member, requests, deadline, timing):
    """A reducer's _send_average that answers nothing and holds the member's stream until its deadline."""
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    return
    yield


def test_a_reducer_that_holds_its_average_to_the_deadline_costs_its_span_only():
    """A modified client's reducer (member 3 of 4) reads every part of its span and never answers, holding each
    member's stream. A member waits for the averages until a request's time (``connect_timeout``) before the
    round's deadline, so every honest reducer's list comes after that and before the deadline: the three honest
    members apply the other three spans, each naming member 3 silent. Before, lists and averages were due at the
    same moment: the lists came too late and nobody applied the round, or one member alone, which then had to
    download the others' state (bench/swarm_attacks.py round_breaker)."""
    torch.manual_seed(10)
    deltas = [torch.randn(NUMEL) for _ in range(4)]
    holding = type("AllReduceServicer", (AllReduceServicer,), {"_send_average": _hold})
    ids, _, rounds, seconds = _rounds(1, deltas, [1.0] * 4, allreduce_timeout=6.0, connect_timeout=1.0,
                                      servicer_of=lambda i: holding if i == 3 else AllReduceServicer)
    for i in range(3):
        res = rounds[0][i]
        assert res.agreed and res.spans[3].average is None, res.spans
        assert all(torch.equal(res.spans[j].average, rounds[0][0].spans[j].average) for j in range(3))
        assert [v.peer for v in res.verdicts if not v.answered] == [str(ids[3])], res.verdicts


def test_a_repeat_offender_is_excluded_then_refused_and_skipped():
    """The same attacker (member 3, parts x1000) over four rounds of one group: every honest reducer cuts its
    part hard each round, and at exclude_after = 3 offences excludes it. In round 4 the honest reducers refuse
    its part (it is not among their contributors) and the honest members skip its span (missing, not applied)."""
    g = torch.Generator().manual_seed(4)
    common = torch.randn(NUMEL, generator=g)
    honest = [common + 0.3 * torch.randn(NUMEL, generator=g) for _ in range(3)]
    deltas, weights = honest + [1000 * honest[0]], [1.0, 1.0, 1.0, 1.0]
    ids, ledgers, rounds, _ = _rounds(4, deltas, weights)
    attacker = str(ids[3])
    for i in range(3):
        assert set(ledgers[i].excluded()) == {attacker}, ledgers[i].excluded()
        assert "clipped" in ledgers[i].excluded()[attacker]
    assert ledgers[3].excluded() == {}  # honest parts are never cut hard
    last = rounds[-1]
    for i in range(3):
        assert last[i].spans[3].average is None  # the attacker's span: skipped
        assert all(3 not in who for j, who in enumerate(last[i].contributors) if j != 3)
        got = [torch.cat([s.average for s in last[k].spans[:3]]) for k in (0, 1, 2)]
        assert torch.equal(got[0], got[i])
