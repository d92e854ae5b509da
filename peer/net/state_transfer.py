"""State transfer: a joining or drifted peer downloads a fragment's shared outer state from a donor.

Every peer keeps an immutable :class:`Snapshot` of each fragment's ``G, v, round`` taken right after
it applied a round, serves it with ``StateServicer.rpc_download`` (protos/state.proto) in chunks of
at most ``chunk_elems`` elements, and advertises ``(round, digest)`` in its progress record. The
receiver checks every chunk (fragment, offsets, sizes, finiteness) and the digest of the assembled
``G`` against the majority's before using anything, and moves to the next donor on any failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from peer.net.bandwidth import Pacer, stream_pacer
from peer.net.limits import StreamGuard, drain, single_request
from peer.outer.state import digest_of
from peer.proto import state_pb2 as pb
from peer.util import time_left, next_by, short_id

log = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    """No donor delivered a verified state."""


@dataclass(frozen=True)
class Snapshot:
    """A fragment's shared outer state after ``round`` rounds (tensors are never modified)."""

    fragment: int
    round: int
    step: int
    G: torch.Tensor
    v: torch.Tensor
    digest: str


def _f32(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4", copy=False).tobytes()


class StateServicer(ServicerBase):
    """Serves this peer's last two snapshots of each fragment (a requester may have seen the previous
    round advertised). :meth:`publish` may be called from any thread (item assignments of new
    objects); the handler reads one snapshot object per request."""

    def __init__(self, chunk_elems: int, *, guard: StreamGuard, request_timeout: float, stream_timeout: float,
                 upload: Optional[Pacer] = None):
        """``request_timeout``: for the request to arrive once the stream is open; ``stream_timeout``: the
        longest one download may hold its stream; ``guard``: this peer's bound on streams per remote peer;
        ``upload``: the owner's upload cap (shared with the all-reduce)."""
        self.chunk_elems = chunk_elems
        self.upload = upload or Pacer(lambda: 0.0)
        self.guard = guard
        self.request_timeout, self.stream_timeout = request_timeout, stream_timeout
        self.snapshots: dict[int, Snapshot] = {}  # the newest, per fragment
        self.previous: dict[int, Snapshot] = {}

    def publish(self, snap: Snapshot) -> None:
        old = self.snapshots.get(snap.fragment)
        if old is not None and old.round != snap.round:
            self.previous[snap.fragment] = old
        self.snapshots[snap.fragment] = snap

    def _find(self, fragment: int, round_: int):
        for snap in (self.snapshots.get(fragment), self.previous.get(fragment)):
            if snap is not None and (round_ == 0 or snap.round == round_):
                return snap
        return None

    async def rpc_download(self, requests: AsyncIterator[pb.StateRequest],
                           context: P2PContext) -> AsyncIterator[pb.StateChunk]:
        with self.guard.admit(str(context.remote_id), self.stream_timeout) as refusal:
            if refusal:
                await drain(requests)
                yield pb.StateChunk(error=refusal)
                return
            try:
                request = await single_request(requests, self.request_timeout)
            except (asyncio.TimeoutError, StopAsyncIteration, ValueError) as e:
                yield pb.StateChunk(error=f"no single request within {self.request_timeout:g} s ({type(e).__name__})")
                return
            async for chunk in self._serve(request):
                yield chunk

    async def _serve(self, request: pb.StateRequest) -> AsyncIterator[pb.StateChunk]:
        snap = self._find(request.fragment, request.round)
        if snap is None:
            yield pb.StateChunk(fragment=request.fragment, error=f"no state for fragment {request.fragment} "
                                                                 f"round {request.round}")
            return
        numel = snap.G.numel()
        to_requester = stream_pacer(request.max_bytes_per_second, 1)  # its declared download cap
        for offset in range(0, numel, self.chunk_elems):
            end = min(numel, offset + self.chunk_elems)
            msg = pb.StateChunk(fragment=snap.fragment, offset=offset, g=_f32(snap.G[offset:end]),
                                v=_f32(snap.v[offset:end]))
            if offset == 0:
                msg.round, msg.digest, msg.numel, msg.step = snap.round, snap.digest, numel, snap.step
            await self.upload.take(msg.ByteSize())
            await to_requester.take(msg.ByteSize())
            yield msg


async def _download_from(p2p: P2P, donor: PeerID, fragment: int, round_: int, numel: int, digest: str,
                         deadline: float, max_chunk_elems: int, pacer: Pacer) -> Snapshot:
    stub = StateServicer.get_stub(p2p, donor)
    request = pb.StateRequest(fragment=fragment, round=round_, max_bytes_per_second=pacer.rate())
    stream = await asyncio.wait_for(stub.rpc_download(request), timeout=time_left(deadline))
    G, v = torch.empty(numel), torch.empty(numel)
    filled, header = 0, None
    try:
        while filled < numel:
            msg = await next_by(stream, deadline)
            if msg.error:
                raise DownloadError(f"donor says: {msg.error}")
            if header is None:
                header = msg
                if msg.numel != numel or msg.digest != digest:
                    raise DownloadError(f"donor offers numel {msg.numel} digest {msg.digest[:12]}, "
                                        f"want {numel} {digest[:12]}")
            n = len(msg.g) // 4
            if (msg.fragment != fragment or msg.offset != filled or n == 0 or n > max_chunk_elems
                    or len(msg.g) != 4 * n or len(msg.v) != 4 * n or filled + n > numel):
                raise DownloadError(f"malformed chunk at offset {msg.offset} ({len(msg.g)} bytes)")
            G[filled:filled + n] = torch.from_numpy(np.frombuffer(msg.g, dtype="<f4").astype(np.float32))
            v[filled:filled + n] = torch.from_numpy(np.frombuffer(msg.v, dtype="<f4").astype(np.float32))
            filled += n
            await pacer.take(msg.ByteSize())
    finally:
        await stream.aclose()
    if not (bool(torch.isfinite(G).all()) and bool(torch.isfinite(v).all())):
        raise DownloadError("state has non-finite values")
    assert header is not None  # numel > 0: the loop read at least one chunk
    got = digest_of(G)
    if got != digest:
        raise DownloadError(f"digest of the downloaded state is {got[:12]}, advertised {digest[:12]}")
    return Snapshot(fragment, int(header.round), int(header.step), G, v, got)


async def download(p2p: P2P, donors: Sequence[PeerID], fragment: int, *, round_: int, numel: int, digest: str,
                   timeout_per_donor: float, max_chunk_elems: int, pacer: Optional[Pacer] = None) -> Snapshot:
    """Downloads round ``round_`` of fragment ``fragment`` from the first donor that delivers a verified state;
    ``pacer``: the owner's download cap."""
    pacer = pacer or Pacer(lambda: 0.0)
    errors = []
    for donor in donors:
        try:
            return await _download_from(p2p, donor, fragment, round_, numel, digest,
                                        time.monotonic() + timeout_per_donor, max_chunk_elems, pacer)
        except Exception as e:  # a dead, slow or lying donor: try the next one
            log.warning("state download of fragment %d from %s failed: %s: %s", fragment, short_id(donor),
                        type(e).__name__, e)
            errors.append(f"{short_id(donor)}: {type(e).__name__}")
    tried = "; ".join(errors) or "no donors"
    raise DownloadError(f"fragment {fragment}: no donor delivered a verified state ({tried})")
