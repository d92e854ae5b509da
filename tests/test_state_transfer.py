"""State transfer: the catch-up plan (pure) and downloads from lying, dying and good donors."""

from typing import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2PContext

from helpers import p2p_mesh, run_async
from peer.outer import digest_of
from peer.progress import ProgressRecord
from peer.proto import state_pb2 as pb
from peer.state_transfer import DownloadError, Snapshot, StateServicer, download, launch_gate, plan_catch_up


def rec(pid, rounds, digests):
    return ProgressRecord(peer_id=pid, step=0, round=rounds[0], tokens_per_second=0.0, client_mode=False, time=0.0,
                          rounds=rounds, digests=digests)


def test_joiner_downloads_every_fragment_where_it_is_behind():
    records = {p: rec(p, [7, 6], ["a", "b"]) for p in ("x", "y")}
    records["z"] = rec("z", [7, 5], ["c", "q"])  # one peer disagrees at round 7: the majority wins
    plans = plan_catch_up(records, "me", [0, 0], ["init", "init"], joining=True)
    assert [(c.fragment, c.round, c.digest, sorted(c.donors)) for c in plans] == [
        (0, 7, "a", ["x", "y"]), (1, 6, "b", ["x", "y"])]


def test_running_peer_tolerates_one_round_of_lag_but_not_two_or_a_minority_digest():
    records = {p: rec(p, [5], ["a"]) for p in ("x", "y")}
    assert plan_catch_up(records, "me", [4], ["old"], joining=False) == []  # about to apply round 5 itself
    assert plan_catch_up(records, "me", [3], ["old"], joining=False)[0].round == 5
    drifted = plan_catch_up(records, "me", [5], ["mine"], joining=False)
    assert drifted and drifted[0].digest == "a" and "disagrees" in drifted[0].reason
    assert plan_catch_up(records, "me", [5], ["a"], joining=False) == []


def test_two_survivors_that_diverged_converge_on_the_smaller_digest():
    assert plan_catch_up({"x": rec("x", [5], ["a"])}, "me", [5], ["b"], joining=False)[0].digest == "a"
    assert plan_catch_up({"x": rec("x", [5], ["b"])}, "me", [5], ["a"], joining=False) == []  # we keep ours
    three_way = {"x": rec("x", [5], ["c"]), "y": rec("y", [5], ["a"])}
    assert plan_catch_up(three_way, "me", [5], ["b"], joining=False)[0].digest == "a"
    assert plan_catch_up({"me": rec("me", [9], ["z"])}, "me", [0], ["i"], joining=True) == []  # ourselves


def test_launch_gate_skips_rounds_the_swarm_is_past():
    records = {p: rec(p, [7, 6], ["a", "b"]) for p in ("x", "y")}
    # in step with the swarm (it applied round 7; we applied 7, or have it in flight): launch round 8
    assert launch_gate(records, "me", 0, 8, my_expected=7) is None
    # late: the swarm already applied the round we are about to launch, no one will come
    assert launch_gate(records, "me", 0, 7, my_expected=6).startswith("late")
    # one round behind (we missed round 7): join the swarm's current round, the drift check repairs us
    assert launch_gate(records, "me", 0, 8, my_expected=6) is None
    # behind: our round counter ran on alone during an outage, our state is many rounds old
    assert launch_gate(records, "me", 0, 8, my_expected=5).startswith("behind")
    assert launch_gate(records, "me", 1, 46, my_expected=2).startswith("behind")
    assert launch_gate({}, "me", 0, 3, my_expected=0) is None  # no one else: nothing to be behind of
    # the repair, once a round was late: every fragment the swarm is past, counting our rounds in flight
    # (fragment 1: applied 5, round 6 in flight, swarm at 6: nothing to download); a drift check tolerates one
    assert plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False) == []
    plans = plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False, expected=[6, 6])
    assert [(c.fragment, c.round, c.digest) for c in plans] == [(0, 7, "a")]
    plans = plan_catch_up(records, "me", [6, 5], ["a0", "b0"], joining=False, expected=[6, 5])
    assert [(c.fragment, c.round, c.digest) for c in plans] == [(0, 7, "a"), (1, 6, "b")]


class DyingServicer(StateServicer):
    """Sends the first chunk, then breaks the stream (a donor killed mid-download)."""

    async def rpc_download(self, request: pb.StateRequest, context: P2PContext) -> AsyncIterator[pb.StateChunk]:
        async for i, msg in _enumerate(super().rpc_download(request, context)):
            if i == 1:
                raise ConnectionResetError("donor died")
            yield msg


async def _enumerate(aiter):
    i = 0
    async for x in aiter:
        yield i, x
        i += 1


async def _scenario(numel, donors_kind):
    torch.manual_seed(0)
    G, v = torch.randn(numel), torch.randn(numel)
    good = Snapshot(0, 9, 90, G, v, digest_of(G))
    p2ps = await p2p_mesh(1 + len(donors_kind))
    try:
        for kind, p in zip(donors_kind, p2ps[1:]):
            servicer = {"dying": DyingServicer, "good": StateServicer, "lying": StateServicer}[kind](chunk_elems=100)
            snap = good if kind != "lying" else Snapshot(0, 9, 90, G + 1, v, good.digest)  # claims the good digest
            servicer.publish(snap)
            await servicer.add_p2p_handlers(p)
        return good, await download(p2ps[0], [p.peer_id for p in p2ps[1:]], 0, round_=9, numel=numel,
                                    digest=good.digest,
                                    timeout_per_donor=10, max_chunk_elems=100)
    finally:
        for p in p2ps:
            await p.shutdown()


def test_download_switches_donor_when_one_dies_or_lies():
    good, got = run_async(_scenario(1000, ["dying", "lying", "good"]))
    assert got.round == 9 and got.step == 90 and got.digest == good.digest
    assert torch.equal(got.G, good.G) and torch.equal(got.v, good.v)


def test_download_fails_cleanly_without_an_honest_donor():
    with pytest.raises(DownloadError, match="no donor delivered"):
        run_async(_scenario(1000, ["dying", "lying"]))
