"""State transfer: downloads from lying, dying and good donors (the catch-up plan: test_consensus.py)."""

from typing import AsyncIterator

import pytest
import torch
from hivemind.p2p import P2PContext

from helpers import p2p_mesh, run_async
from peer.outer.state import digest_of
from peer.proto import state_pb2 as pb
from peer.net.state_transfer import DownloadError, Snapshot, StateServicer, download


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
