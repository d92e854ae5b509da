"""One round's decision after its group assembled (peer/net/round/round_runner.py), with the swarm it reads faked
and the all-reduce replaced by one that returns every span: whether we apply, and whom the round makes partners.

The case is a hostile leader's: it takes one honest peer into a group of ids of its own, each declaring the
honest base and a count of 1, so the group's verdict (the upper median of the declared counts) says apply. And a
member in two groups of one round: the claims we hold and the ones the records publish (peer/net/trust/claims.py).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.crypto import RSAPrivateKey

from peer.config import SwarmConfig
from peer.net.flow.links import DeadlinePolicy
from peer.net.round import round_runner
from peer.net.round.allreduce import AllReduceResult
from peer.net.round.group import PROTOCOL_VERSION
from peer.net.round.round_runner import RoundRunner
from peer.net.trust.auth import peer_id_of
from peer.net.trust.claims import ClaimSigner, statement
from peer.outer.aggregate import AggregationRule
from peer.outer.codec import get_codec
from peer.outer.rounds import RoundOutcome, RoundStatus, Span
from peer.proto import allreduce_pb2 as pb

NUMEL, BASE, GID, RUN = 64, "ab" * 16, b"g" * 20, "t"
# every member's identity (its peer id is the hash of its key): the honest peers our round counts, us included, and
# made-up ids of a hostile leader's
SIGNERS = {name: ClaimSigner(RSAPrivateKey(), RUN) for name in ["h0", "h1", "h2", "h3", "h4", "s1", "s2", "s3", "s4"]}
P = {name: peer_id_of(signer._key.get_public_key()) for name, signer in SIGNERS.items()}
NAME = {pid: name for name, pid in P.items()}


def sign(name: str, stmt: bytes) -> pb.MemberClaim:
    return pb.MemberClaim(key=SIGNERS[name].public, signature=SIGNERS[name]._key.sign(stmt))
ME, HONEST = P["h0"], [P[f"h{i}"] for i in range(5)]


class FakeSwarm:
    """What :class:`RoundRunner` reads of a swarm (``SwarmView``), and the lessons it hands back."""

    def __init__(self):
        self.cfg = SwarmConfig()
        self.peer_id, self.client_mode, self.run_key = ME, False, RUN
        self.codec, self.rule = get_codec("fp32"), AggregationRule()
        self.policy = DeadlinePolicy.of(self.cfg)
        self.p2p = SimpleNamespace(peer_id=ME)
        self.dht = self.servicer = self.guard = self.bandwidth = None
        self.lessons: list = []
        self.published: list = []  # claims the others' records publish (witness)
        self.witnessed: list = []  # what our round published
        self.readable = True  # whether the store and read of the records end in time
        self.order: list[str] = []  # when the witness started, and when the all-reduce ended

    async def claim(self, here, stmt):
        return sign("h0", stmt)

    async def witness(self, here, entries, keys):
        self.witnessed.append(entries)
        self.keys = dict(keys)
        self.order.append(f"witness of {len(entries)}")
        return [*self.published, *entries] if self.readable else None

    def live_peers(self):
        return {}

    vouched_peers = live_peers

    def refused(self, peer):
        return False

    def admitted(self, peer):
        return True

    def declared_uplink(self):
        return 0.0

    def vouched_speed(self, peer, now):
        return None

    def allowance(self, peer):
        return self.cfg.matchmaking_time

    def invited(self, here):
        return frozenset(HONEST) - {ME}

    def quorum_peers(self, invited, here):
        return frozenset(HONEST)

    def learn(self, lesson):
        self.lessons.append(lesson)
        return []


def group(ids: list[str], counts: list[int], bases: list[str] | None = None) -> GroupInfo:
    infos = [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=1.0, numel=NUMEL, base=b, expected=c,
                           span_key=bytes(32))
             for c, b in zip(counts, bases or [BASE] * len(ids))]
    return GroupInfo(GID, tuple(ids), tuple(i.SerializeToString() for i in infos))


def decide(monkeypatch, ids: list[str], counts: list[int], bases: list[str] | None = None, *,
           unclaimed: tuple[str, ...] = (), swarm: FakeSwarm | None = None) -> tuple[RoundOutcome, FakeSwarm]:
    """Round 3 of fragment 0 in the group ``ids``, every span arriving, and every member's claim for the group but
    ``unclaimed``'s."""
    async def every_span_arrives(p2p, servicer, plan, delta, weight, claims, **kwargs):
        for i, pid in enumerate(plan.peer_ids):
            if pid not in unclaimed:
                claims.add(i, sign(NAME[pid], claims.stmt))
        await asyncio.sleep(0)  # (one turn of the loop: a store started when the last claim came in runs)
        swarm.order.append("all-reduce ends")
        return AllReduceResult(spans=[Span(a, b, torch.zeros(b - a)) for a, b in plan.spans],
                               contributors=[list(range(len(plan.peer_ids)))] * len(plan.spans), agreed=True)

    monkeypatch.setattr(round_runner, "run_allreduce", every_span_arrives)
    swarm = swarm or FakeSwarm()
    runner = RoundRunner(swarm, fragment=0, round_=3, inner_step=60, target_group_size=len(HONEST), sync_every=20)
    runner.counted = swarm.quorum_peers(swarm.invited((0, 3)), (0, 3))  # (what the search declared)
    out = RoundOutcome(0, 3, RoundStatus.FAILED, base=BASE)
    asyncio.run(runner._reduce(group(ids, counts, bases), torch.ones(NUMEL), 1.0, out))
    return out, swarm


def test_a_group_of_made_up_ids_that_declare_a_count_of_one_is_not_applied(monkeypatch):
    out, swarm = decide(monkeypatch, [ME, P["s1"], P["s2"], P["s3"], P["s4"]], [5, 1, 1, 1, 1])
    assert out.status == RoundStatus.MINORITY and out.applied_spans() == [], out
    assert "1 of the 5 peers we count" in out.error
    came = [lesson.came for lesson in swarm.lessons if lesson.came is not None]
    assert came == [frozenset({ME})], came  # the made-up ids did not become partners (they would count next time)


@pytest.mark.parametrize("ids", [HONEST[:3], [*HONEST[:3], P["s1"], P["s2"]]])
def test_a_group_holding_a_majority_of_our_count_is_applied_and_its_members_met(monkeypatch, ids):
    out, swarm = decide(monkeypatch, ids, [5] * len(ids))
    assert out.status == RoundStatus.OK and len(out.applied_spans()) == len(ids), out
    assert [lesson.came for lesson in swarm.lessons if lesson.came is not None] == [frozenset(ids)]


def test_made_up_ids_that_outvote_our_base_make_the_group_not_ours_and_are_no_donors(monkeypatch):
    """Three of the five peers we count, on our base, and four made-up ids declaring another: the group's base is
    theirs, so we would be off base and download what its appliers (theirs) hold. By our count it is not ours."""
    other = "cd" * 16
    ids = [*HONEST[:3], P["s1"], P["s2"], P["s3"], P["s4"]]
    out, swarm = decide(monkeypatch, ids, [5] * 7, [BASE] * 3 + [other] * 4)
    assert out.group_base == other and out.status == RoundStatus.MINORITY, out
    assert "declared another base" in out.error and out.appliers == [], out


def test_a_search_is_not_given_up_for_a_far_ahead_record_that_ties_our_one_partner():
    """The search for round 3 ends as ``late`` when the swarm's state is past it. Our base (the state the round
    applies to) counts as one holder: the partner that holds it and we outvote a record claiming round 1002, which
    alone against the partner was a tie the later round won (bench/swarm_attacks.py served_ahead)."""
    from peer.net.trust.records import ProgressRecord

    def rec(pid, round_, digest):
        return ProgressRecord(peer_id=pid, step=40, round=round_, tokens_per_second=1.0, client_mode=False,
                              time=0.0, rounds=[round_], digests=[digest])

    swarm = FakeSwarm()
    records = {P["h1"]: rec(P["h1"], 2, BASE), P["s1"]: rec(P["s1"], 1002, "ff" * 16)}
    swarm.live_peers = swarm.vouched_peers = lambda: records
    runner = RoundRunner(swarm, fragment=0, round_=3, inner_step=60, target_group_size=3, sync_every=20)
    runner.base = (2, BASE)
    assert runner._give_up() is None
    runner.base = None  # (without ours: what the tie did)
    gave_up = runner._give_up()
    assert gave_up is not None and gave_up.status == RoundStatus.BEHIND and "1002" in str(gave_up)


def test_what_a_search_we_led_waited_for_each_peer_is_handed_back_as_a_lesson(monkeypatch):
    """The waits a leader noted (peer/net/view/punctuality.py) reach the swarm, which settles each peer's allowance,
    whether or not a group formed; the search reads the swarm's allowances."""
    seen = {}

    async def led(*args, waits, **kwargs):
        seen["allowance"] = waits.allowance("A")
        waits.waited = {"A": 0.0, "B": 2.5}
        return None

    monkeypatch.setattr(round_runner, "form_group", led)
    swarm = FakeSwarm()
    swarm.servicer = SimpleNamespace(signer=SimpleNamespace(public=bytes(32)))
    swarm.bandwidth = SimpleNamespace(download=SimpleNamespace(rate=lambda: 0.0))
    runner = RoundRunner(swarm, fragment=0, round_=3, inner_step=60, target_group_size=len(HONEST), sync_every=20)
    assert asyncio.run(runner._find_group(torch.ones(NUMEL), 1.0, 2, BASE)) is None
    assert seen["allowance"] == swarm.cfg.matchmaking_time
    assert [lesson.waited for lesson in swarm.lessons] == [(("A", 0.0), ("B", 2.5))]


def another_group(name: str, gid: bytes = b"o" * 20, signer: str = "") -> tuple:
    """A record's entry: ``name``'s claim for group ``gid`` of our round, signed by ``signer`` (default its own)."""
    import base64

    claim = sign(signer or name, statement(RUN, 0, 3, gid))
    return 0, 3, base64.b64encode(gid).decode(), P[name], base64.b64encode(claim.signature).decode()


def test_a_member_another_record_shows_in_another_group_of_the_round_is_not_counted(monkeypatch):
    """Three of the five we count, h2 also in another group (its claim for it, published by a member there): by the
    claims, two of five. We published the claims we hold before we read (the other group sees ours if it reads
    second), and handed the swarm the keys of our members' claims (it judges the two claims: test_claims.py)."""
    swarm = FakeSwarm()
    swarm.published = [another_group("h2")]
    out, swarm = decide(monkeypatch, HONEST[:3], [5] * 3, swarm=swarm)
    assert out.status == RoundStatus.MINORITY and out.applied_spans() == [], out
    assert "hold 2 of the 5 peers we count" in out.error and "claimed another group" in out.error, out.error
    assert [{e[3] for e in entries} for entries in swarm.witnessed] == [{P["h1"], P["h2"]}]
    assert set(swarm.keys) == set(HONEST[:3])


def test_a_group_that_holds_our_count_without_the_member_in_two_groups_applies(monkeypatch):
    swarm = FakeSwarm()
    swarm.published = [another_group("h3")]
    out, swarm = decide(monkeypatch, HONEST[:4], [5] * 4, swarm=swarm)
    assert out.status == RoundStatus.OK and len(out.applied_spans()) == 4, out


@pytest.mark.parametrize("entry", [another_group("h2", signer="s1"),  # forged by another peer's key
                                   another_group("h2", gid=GID),  # its claim for our own group
                                   (0, 4, *another_group("h2")[2:]),  # another round's
                                   another_group("s1")])  # a peer not in our group
def test_entries_that_prove_no_second_group_change_nothing(monkeypatch, entry):
    swarm = FakeSwarm()
    swarm.published = [entry]
    out, swarm = decide(monkeypatch, HONEST[:3], [5] * 3, swarm=swarm)
    assert out.status == RoundStatus.OK and len(out.applied_spans()) == 3, out


def test_a_member_whose_claim_we_do_not_hold_is_not_counted(monkeypatch):
    out, _ = decide(monkeypatch, HONEST[:3], [5] * 3, unclaimed=(P["h2"],))
    assert out.status == RoundStatus.MINORITY and "hold 2 of the 5" in out.error, out


def test_nothing_is_applied_when_the_claims_cannot_be_published_and_read_back(monkeypatch):
    swarm = FakeSwarm()
    swarm.readable = False
    out, _ = decide(monkeypatch, HONEST[:3], [5] * 3, swarm=swarm)
    assert out.status == RoundStatus.MINORITY and "could not be published" in out.error, out


def test_the_witness_runs_while_the_all_reduce_does_once_every_member_s_claim_is_in(monkeypatch):
    """The witness (store, then read) starts as soon as the book holds every member's claim (they come with the
    parts' headers), so a slow DHT node's wait overlaps the all-reduce, and the round takes its answer. A member
    whose claim never comes leaves the witness to after the all-reduce."""
    out, swarm = decide(monkeypatch, HONEST[:3], [5] * 3)
    assert out.status == RoundStatus.OK, out
    assert swarm.order == ["witness of 2", "all-reduce ends"], swarm.order
    out, swarm = decide(monkeypatch, HONEST[:4], [5] * 4, unclaimed=(HONEST[3],))
    assert out.status == RoundStatus.OK, out
    assert swarm.order == ["all-reduce ends", "witness of 2"], swarm.order
