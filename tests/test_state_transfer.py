"""State transfer: downloads from lying, dying and good donors (the catch-up plan: test_consensus.py)."""

import asyncio
import contextlib
import math
import os
import time

import pytest
import torch
from hivemind.p2p import P2P

from helpers import p2p_mesh, run_async
from peer.outer.state import DIGEST_BLOCK, block_digests, digest_of, digest_of_blocks
from peer.net.flow.streams import StreamGuard, cap_frame_size, frame_limit_for
from peer.net.state_transfer import DownloadError, ServedState, StateServicer, download

SERVING = dict(guard=StreamGuard(per_peer=4, total=64), request_timeout=2.0, stream_timeout=30.0)


def dying(servicer: StateServicer) -> StateServicer:
    """Sends the first chunk of an answer, then breaks the stream (a donor killed mid-download). Wraps the
    instance: a subclass would serve under another handler name, which nobody calls."""
    serve = servicer._serve

    async def dies(request, pacer):
        async for i, msg in _enumerate(serve(request, pacer)):
            if i == 1:
                raise ConnectionResetError("donor died")
            yield msg
    servicer._serve = dies
    return servicer


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1


async def _scenario(numel, donors_kind, on_lie=None):
    torch.manual_seed(0)
    G, v = torch.randn(numel), torch.randn(numel)
    good = ServedState(0, 9, 90, G, v, digest_of(G, v))
    p2ps = await p2p_mesh(1 + len(donors_kind))
    try:
        for kind, p in zip(donors_kind, p2ps[1:]):
            servicer = StateServicer(100, **SERVING)
            if kind == "dying":
                dying(servicer)
            snap = good if kind != "lying" else ServedState(0, 9, 90, G + 1, v, good.digest)  # claims the good digest
            servicer.publish(snap)
            await servicer.add_p2p_handlers(p)
        return good, await download(p2ps[0], [p.peer_id for p in p2ps[1:]], 0, round_=9, numel=numel,
                                    digest=good.digest,
                                    timeout_per_donor=10, max_chunk_elems=100, on_lie=on_lie)
    finally:
        for p in p2ps:
            await p.shutdown()


def test_download_switches_donor_when_one_dies_or_lies():
    """The dying donor's part goes to the next; the lying one (values that do not match its block digests) is
    named, once per part it lied in, as an offence (the network's failures are not)."""
    lies = []
    good, got = run_async(_scenario(1000, ["dying", "lying", "good"], on_lie=lambda who, why: lies.append(why)))
    assert got.round == 9 and got.step == 90 and got.digest == good.digest
    assert torch.equal(got.G, good.G) and torch.equal(got.v, good.v)
    assert lies and all("do not match their block digests" in why for why in lies), lies


def test_a_donor_that_holds_no_state_at_the_round_asked_for_is_named():
    """A donor asked for a round it does not serve answers so, and the download says whom (the swarm then takes
    its records for no vote: test_roster.py); the next donor delivers."""
    async def main():
        torch.manual_seed(0)
        G, v = torch.randn(1000), torch.randn(1000)
        good = ServedState(0, 9, 90, G, v, digest_of(G, v))
        p2ps = await p2p_mesh(3)
        try:
            for snap, p in zip((ServedState(0, 8, 80, G, v, good.digest), good), p2ps[1:]):
                servicer = StateServicer(100, **SERVING)
                servicer.publish(snap)
                await servicer.add_p2p_handlers(p)
            unheld: list[str] = []
            got = await download(p2ps[0], [p.peer_id for p in p2ps[1:]], 0, round_=9, numel=1000,
                                 digest=good.digest, timeout_per_donor=10, max_chunk_elems=100, parallel=1,
                                 on_unheld=unheld.append)
            return good, got, unheld, [str(p.peer_id) for p in p2ps[1:]]
        finally:
            for p in p2ps:
                await p.shutdown()

    good, got, unheld, donors = run_async(main())
    assert got.round == 9 and torch.equal(got.G, good.G) and torch.equal(got.v, good.v)
    assert unheld == [donors[0]]  # (the donor of round 8 only; the network's failures are not named)


def test_a_donor_that_names_another_round_is_refused_whatever_its_digest(monkeypatch):
    """The state's digest does not say which round it is: a donor serving the right state under another round (or
    a far step) would move the joiner's round counter. The header must name the round asked for."""
    serve = StateServicer._serve

    async def other_round(self, request, pacer):
        async for msg in serve(self, request, pacer):
            if msg.digest:
                msg.round, msg.step = msg.round + 1000, 10**9
            yield msg

    assert run_async(_scenario(1000, ["good"]))[1].round == 9  # (the same donor, honest)
    monkeypatch.setattr(StateServicer, "_serve", other_round)
    lies = []
    with pytest.raises(DownloadError, match="no donor delivered a verified state"):
        run_async(_scenario(1000, ["good"], on_lie=lambda who, why: lies.append(why)))
    assert lies and "as round 1009, want 9" in lies[0], lies


@pytest.mark.parametrize("cuts", [1, 1000])
def test_a_stream_cut_short_is_asked_again_once(monkeypatch, cuts):
    """An answer that ends before its part without a word from the donor (the transport closed the stream) is
    asked for again from the same donor, once, for the rest of the part: the only donor's state still arrives
    and no element is sent twice; a donor whose streams keep ending early is given up."""
    serve, cut, served = StateServicer._serve, [0], [0]

    async def short(self, request, pacer):
        async for i, msg in _enumerate(serve(self, request, pacer)):
            if i == 1 and cut[0] < cuts:
                cut[0] += 1
                return  # a clean end of the stream, one chunk into the part
            served[0] += len(msg.g) // 4
            yield msg

    monkeypatch.setattr(StateServicer, "_serve", short)
    if cuts == 1:
        good, got = run_async(_scenario(1000, ["good"]))
        assert torch.equal(got.G, good.G) and torch.equal(got.v, good.v) and cut[0] == 1
        assert served[0] == 1000  # the cut part was asked for from where it stopped
    else:
        with pytest.raises(DownloadError, match="StopAsyncIteration"):
            run_async(_scenario(1000, ["good"]))
        assert cut[0] == 2


def test_download_fails_cleanly_without_an_honest_donor():
    with pytest.raises(DownloadError, match="no donor delivered"):
        run_async(_scenario(1000, ["dying", "lying"]))


def counting(servicer: StateServicer) -> StateServicer:
    """Counts in ``servicer.parts`` the requests it answers with data (an instance attribute: a subclass would
    serve under another handler name)."""
    serve, servicer.parts = servicer._serve, 0

    async def counted(request, pacer):
        async for i, msg in _enumerate(serve(request, pacer)):
            servicer.parts += i == 0 and not msg.error
            yield msg
    servicer._serve = counted
    return servicer


def test_a_state_comes_in_verified_parts_from_several_donors_and_a_liar_costs_only_its_parts():
    """Three blocks of state from three donors at once: each serves parts of it. A donor that sends the true
    header (digest, block digests) but altered values has each of its parts refused (block digests) and
    fetched again from another; a busy donor (it serves no one more now) is passed over, and named as one that
    failed to deliver (three downloads in a row and its records are no vote: test_roster.py), the donors that
    delivered as such. The state that comes in is the donors' to the bit."""
    numel = 2 * DIGEST_BLOCK + 1000
    torch.manual_seed(1)
    G, v = torch.randn(numel), torch.randn(numel)
    good = ServedState(0, 9, 90, G, v, digest_of(G, v))

    async def main(kinds, parallel):
        p2ps = await p2p_mesh(1 + len(kinds))
        try:
            servicers = []
            for kind, p in zip(kinds, p2ps[1:]):
                servicer = counting(StateServicer(100_000, **SERVING, max_uploads=0 if kind == "busy" else 2))
                liar = ServedState(0, 9, 90, G + 1, v, good.digest, block_digests(G, v))  # true header, false values
                servicer.publish(liar if kind == "lying" else good)
                await servicer.add_p2p_handlers(p)
                servicers.append(servicer)
            failed: list[str] = []
            served: list[str] = []
            got = await download(p2ps[0], [p.peer_id for p in p2ps[1:]], 0, round_=9, numel=numel,
                                 digest=good.digest, timeout_per_donor=20, max_chunk_elems=100_000,
                                 parallel=parallel, on_failed=failed.append, on_served=served.append)
            ids = [str(p.peer_id) for p in p2ps[1:]]
            return got, [s.parts for s in servicers], [ids.index(d) for d in failed], sorted(map(ids.index, served))
        finally:
            for p in p2ps:
                await p.shutdown()

    got, parts, failed, served = run_async(main(["good", "good", "good"], 3))
    assert torch.equal(got.G, G) and torch.equal(got.v, v) and got.digest == good.digest and got.round == 9
    assert all(n >= 1 for n in parts) and sum(parts) == 3, parts  # three parts of one block, one per donor
    assert failed == [] and served == [0, 1, 2]
    got, parts, failed, served = run_async(main(["lying", "busy", "good", "good"], 2))
    assert torch.equal(got.G, G) and torch.equal(got.v, v)
    assert parts[0] == 1 and parts[1] == 0 and sum(parts[2:]) == 3, parts  # the liar's one part was fetched again
    assert failed == [1] and served == [i for i in (2, 3) if parts[i]]  # (the liar is an offence, not a failure)


def test_the_digest_covers_g_and_v_block_by_block():
    G, v = torch.randn(DIGEST_BLOCK + 5), torch.randn(DIGEST_BLOCK + 5)
    blocks = block_digests(G, v)
    assert len(blocks) == 2 and digest_of(G, v) == digest_of_blocks(blocks)
    v2 = v.clone()
    v2[-1] += 1  # a change in the last block's momentum changes that block's digest only, and the state's
    assert block_digests(G, v2)[0] == blocks[0] and block_digests(G, v2)[1] != blocks[1]
    assert digest_of(G, v2) != digest_of(G, v)


def _fds(p2p) -> int:
    return len(os.listdir(f"/proc/{p2p._child.pid}/fd"))


@pytest.mark.timeout(120)
def test_never_finished_requests_are_bounded_per_peer_and_end_at_their_deadline():
    """One peer opens 300 download streams and never sends a request (before: 17,000 such streams grew a
    peer's descriptors until its daemon died). The victim holds at most ``per_peer`` of them, each for
    ``request_timeout``; an honest peer downloads meanwhile; afterwards the victim's daemon is back to
    the descriptors it had."""
    async def main():
        victim, attacker, honest = await p2p_mesh(3)
        try:
            G, v = torch.randn(1000), torch.randn(1000)
            guard = StreamGuard(per_peer=4, total=64)
            servicer = StateServicer(100, guard=guard, request_timeout=1.0, stream_timeout=30.0)
            servicer.publish(ServedState(0, 9, 90, G, v, digest_of(G, v)))
            await servicer.add_p2p_handlers(victim)
            fds_before = _fds(victim)
            name = StateServicer._get_handle_name(None, "rpc_download")
            held, peak, t0 = [], 0, time.monotonic()
            for _ in range(300):
                held.append(await attacker.call_binary_stream_handler(victim.peer_id, name))
                peak = max(peak, guard.open.get(str(attacker.peer_id), 0))
            opening = time.monotonic() - t0
            got = await download(honest, [victim.peer_id], 0, round_=9, numel=1000, digest=digest_of(G, v),
                                 timeout_per_donor=10, max_chunk_elems=100)
            deadline = time.monotonic() + 20
            while guard.open_total and time.monotonic() < deadline:  # each ends request_timeout after it opened
                await asyncio.sleep(0.1)
            for _, _, writer in held:
                writer.close()
            deadline = time.monotonic() + 20
            while _fds(victim) > fds_before + 8 and time.monotonic() < deadline:  # the daemon closes them
                await asyncio.sleep(0.1)
            return got, G, peak, guard, _fds(victim) - fds_before, opening
        finally:
            for p in (victim, attacker, honest):
                await p.shutdown()

    got, served, peak, guard, extra_fds, opening = run_async(main())
    assert torch.equal(got.G, served) and got.round == 9
    # Each of the 4 slots holds a stream for request_timeout (1 s), so while the 300 opened each slot admitted at
    # most one stream per second of the opening, plus one that ended as it ran: the rest were refused.
    admitted = 300 - guard.refused
    assert peak <= 4 and admitted <= 4 * (2 + math.floor(opening / 1.0)), (admitted, opening)
    assert guard.open_total == 0
    assert extra_fds <= 8, extra_fds


@pytest.mark.timeout(120)
def test_a_frame_declaring_a_huge_length_is_refused_before_its_body_is_read(caplog):
    """A frame whose prefix declares 2^40 bytes (before: the peer allocated over 2 GiB) closes the stream at
    once, without reading the body; the victim serves an honest download right after."""
    cap_frame_size(frame_limit_for(1 << 20))

    async def main():
        victim, attacker = await p2p_mesh(2)
        try:
            G, v = torch.randn(1000), torch.randn(1000)
            servicer = StateServicer(100, **SERVING)
            servicer.publish(ServedState(0, 9, 90, G, v, digest_of(G, v)))
            await servicer.add_p2p_handlers(victim)
            rss_before = _rss()
            _, reader, writer = await attacker.call_binary_stream_handler(
                victim.peer_id, StateServicer._get_handle_name(None, "rpc_download"))
            writer.write(P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                for _ in range(64):  # 64 MiB of body, which the victim must not take in
                    writer.write(bytes(1 << 20))
                    await asyncio.wait_for(writer.drain(), timeout=5)
            try:  # the victim closed the stream: an end of file, or a reset once our unread writes are dropped
                answer = await asyncio.wait_for(reader.read(), timeout=10)
            except ConnectionError:
                answer = b""
            writer.close()
            got = await download(attacker, [victim.peer_id], 0, round_=9, numel=1000, digest=digest_of(G, v),
                                 timeout_per_donor=10, max_chunk_elems=100)
            return answer, got, _rss() - rss_before
        finally:
            for p in (victim, attacker):
                await p.shutdown()

    answer, got, grown = run_async(main())
    assert answer == b"" and got.round == 9
    assert "refused a stream frame declaring 1099511627776 bytes" in caplog.text
    assert grown < 32 << 20, grown


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_our_record_advertises_and_votes_with_the_state_we_serve():
    """OurRecord.held: the (round, digest) of the snapshot we serve, our vote on the swarm's state
    (consensus.swarm_state's ``mine``), and what our record advertises."""
    from peer.net.our_record import OurRecord

    ours = OurRecord(StateServicer(100, **SERVING))
    assert ours.held(0) is None and ours.applied_rounds() == []
    G = torch.arange(8, dtype=torch.float32)
    ours.publish_snapshot(ServedState(0, 3, 60, G, torch.zeros(8), digest_of(G, torch.zeros(8))))
    assert ours.held(0) == (3, digest_of(G, torch.zeros(8))) and ours.held(1) is None
    assert ours.applied_rounds() == [3]
