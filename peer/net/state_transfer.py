"""State transfer: a joining or drifted peer downloads a fragment's shared outer state from donors.

Every peer keeps an immutable :class:`ServedState` of each fragment's ``G, v, round`` taken right after it applied a
round, serves ranges of it with ``StateServicer.rpc_download`` (protos/state.proto) in chunks of at most
``chunk_elems`` elements, and advertises ``(round, digest)`` in its progress record. The digest is made of the
state's block digests (:func:`peer.outer.state.block_digests`), which every answer carries, so a receiver can
verify each block on its own: :func:`download` takes parts of the fragment from up to ``parallel`` donors at once
(a part that fails, or a donor that lies, dies or is busy, goes to the next donor), checks every chunk (fragment,
offsets, sizes, finiteness) and every block against the majority's digest before using anything. A donor serves
at most ``max_uploads`` downloads at once and tells the others it is busy, so many joiners cannot swamp one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from peer.net.flow.bandwidth import Pacer, share, stream_pacer
from peer.net.flow.streams import StreamGuard, drain, single_request
from peer.outer.codec import all_finite
from peer.outer.state import DIGEST_BLOCK, block_digests, digest_of_blocks
from peer.proto import state_pb2 as pb
from peer.util import next_by, short_id, time_left

log = logging.getLogger(__name__)
PARTS_PER_DONOR = 8  # a download is cut into about this many parts per donor in use: a slow donor holds few
NO_STATE = "no state for fragment"  # how a donor's answer begins when it holds no state at the round asked for


class DownloadError(RuntimeError):
    """No donor delivered a verified state."""


class NotHeld(DownloadError):
    """The donor says it holds no state of the fragment at the round asked for (its record advertised one)."""


class DonorLied(DownloadError):
    """A donor sent what no honest one sends: values that do not match the block digests it sent, non-finite
    values, block digests that do not make the digest, a malformed chunk, or the wanted state under another
    round. (A donor that is busy, gone, slow, or holds another state is not lying.)"""


@dataclass(frozen=True)
class ServedState:
    """A fragment's shared outer state after ``round`` rounds, as a donor serves it and :func:`download` returns it
    (tensors are never modified)."""

    fragment: int
    round: int
    step: int
    G: torch.Tensor
    v: torch.Tensor
    digest: str
    blocks: list[bytes] = field(default_factory=list, compare=False)  # block digests ([] until served once)


def _f32(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4", copy=False).tobytes()


class StateServicer(ServicerBase):
    """Serves this peer's last two snapshots of each fragment (a requester may have seen the previous
    round advertised). :meth:`publish` may be called from any thread (item assignments of new
    objects); the handler reads one snapshot object per request. The snapshots are written by :meth:`publish`
    only (the training thread's, through ``OurRecord.publish_snapshot``); ``serving`` and the requesters' pacers by
    the handler, on ``swarm-net``."""

    def __init__(self, chunk_elems: int, *, guard: StreamGuard, request_timeout: float, stream_timeout: float,
                 upload: Optional[Pacer] = None, max_uploads: int = 2):
        """``request_timeout``: for the request to arrive once the stream is open; ``stream_timeout``: the
        longest one download may hold its stream; ``guard``: this peer's bound on streams per remote peer;
        ``upload``: the owner's upload cap (shared with the all-reduce); ``max_uploads``: downloads served at
        once (others are told "busy" and go to another donor)."""
        self.chunk_elems = chunk_elems
        self.upload = upload or Pacer(lambda: 0.0)
        self.guard = guard
        self.request_timeout, self.stream_timeout = request_timeout, stream_timeout
        self.max_uploads = max_uploads
        self.serving = 0  # downloads being served now
        # per requester: (the rate it declared, its pacer), so the parts it asks for one after another share one
        # budget (a fresh pacer per part would let each part's first bytes through at once); the latest 64
        self._to_requester: dict[str, tuple[float, Pacer]] = {}
        self.snapshots: dict[int, ServedState] = {}  # the newest, per fragment
        self.previous: dict[int, ServedState] = {}

    def publish(self, snap: ServedState) -> None:
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
            if self.serving >= self.max_uploads:
                yield pb.StateChunk(fragment=request.fragment, error=f"busy: serving {self.serving} downloads")
                return
            self.serving += 1
            try:
                async for chunk in self._serve(request, self._pacer_for(str(context.remote_id), request)):
                    yield chunk
            finally:
                self.serving -= 1

    def _pacer_for(self, requester: str, request: pb.StateRequest) -> Pacer:
        """The pacer of ``requester``'s declared download cap (:func:`stream_pacer`), kept across its requests."""
        declared, pacer = self._to_requester.pop(requester, (None, None))
        if pacer is None or declared != request.max_bytes_per_second:
            declared, pacer = request.max_bytes_per_second, stream_pacer(request.max_bytes_per_second, 1)
        self._to_requester[requester] = (declared, pacer)  # (re-inserted: the newest last)
        while len(self._to_requester) > 64:
            self._to_requester.pop(next(iter(self._to_requester)))
        return pacer

    async def _serve(self, request: pb.StateRequest, to_requester: Pacer) -> AsyncIterator[pb.StateChunk]:
        snap = self._find(request.fragment, request.round)
        if snap is None:
            yield pb.StateChunk(fragment=request.fragment, error=f"{NO_STATE} {request.fragment} round {request.round}")
            return
        numel = snap.G.numel()
        end = numel if request.count == 0 else min(numel, request.offset + request.count)
        if request.offset >= end:
            yield pb.StateChunk(fragment=request.fragment, error=f"no elements in [{request.offset}, {end})")
            return
        if not snap.blocks:  # (a snapshot made without them) computed once, off the event loop
            blocks = await asyncio.get_running_loop().run_in_executor(None, block_digests, snap.G, snap.v)
            if not snap.blocks:  # (another request may have filled them meanwhile)
                snap.blocks.extend(blocks)
        for offset in range(request.offset, end, self.chunk_elems):
            stop = min(end, offset + self.chunk_elems)
            msg = pb.StateChunk(fragment=snap.fragment, offset=offset, g=_f32(snap.G[offset:stop]),
                                v=_f32(snap.v[offset:stop]))
            if offset == request.offset:
                msg.round, msg.digest, msg.numel, msg.step = snap.round, snap.digest, numel, snap.step
                msg.blocks.extend(snap.blocks)
            await self.upload.take(msg.ByteSize())
            await to_requester.take(msg.ByteSize())
            yield msg


@dataclass
class _Assembly:
    """What a download has so far: the state being filled, the parts still wanted, the verified block digests."""

    numel: int
    digest: str
    G: torch.Tensor
    v: torch.Tensor
    parts: list[tuple[int, int]]  # [start, end) element ranges still wanted (block-aligned)
    want_round: int  # the round asked for: a header that names another is refused
    blocks: Optional[list[bytes]] = None  # trusted once their hash is the digest
    round: int = 0
    step: int = 0
    done: int = 0  # parts verified
    received: int = 0  # bytes of chunks read (the joiner's downlink sample: peer/net/flow/links.py)

    def check_header(self, msg: pb.StateChunk) -> None:
        """Checks an answer's header against the digest wanted; the first good one sets the block digests."""
        if msg.numel != self.numel or msg.digest != self.digest:
            raise DownloadError(f"donor offers numel {msg.numel} digest {msg.digest[:12]}, "
                                f"want {self.numel} {self.digest[:12]}")
        if msg.round != self.want_round:
            raise DonorLied(f"donor offers the wanted state as round {msg.round}, want {self.want_round}")
        if self.blocks is None:
            blocks = list(msg.blocks)
            if (len(blocks) != math.ceil(self.numel / DIGEST_BLOCK) or any(len(b) != 16 for b in blocks)
                    or digest_of_blocks(blocks) != self.digest):
                raise DonorLied("donor's block digests do not make the digest")
            self.blocks, self.round, self.step = blocks, int(msg.round), int(msg.step)

    def verify(self, start: int, end: int) -> None:
        """Checks the blocks of ``[start, end)`` (block-aligned) against the trusted digests."""
        assert self.blocks is not None
        G, v = self.G[start:end], self.v[start:end]
        if not (all_finite(G) and all_finite(v)):
            raise DonorLied(f"non-finite values in [{start}, {end})")
        if block_digests(G, v) != self.blocks[start // DIGEST_BLOCK:math.ceil(end / DIGEST_BLOCK)]:
            raise DonorLied(f"elements [{start}, {end}) do not match their block digests")


async def _fetch(p2p: P2P, donor: PeerID, fragment: int, round_: int, part: tuple[int, int], got: _Assembly,
                 deadline: float, max_chunk_elems: int, pacer: Pacer, declared: float, filled: list[int]) -> None:
    """Downloads ``part`` of the state from ``donor`` into ``got`` and verifies its blocks. ``filled``: one
    element, where the part's elements before ``filled[0]`` are already in ``got`` (from this donor: a stream of
    its cut short); asks for the rest and moves ``filled[0]`` as chunks come. Raises StopAsyncIteration when the
    stream ends early."""
    start, end = part
    stub = StateServicer.get_stub(p2p, donor)
    request = pb.StateRequest(fragment=fragment, round=round_, max_bytes_per_second=declared, offset=filled[0],
                              count=end - filled[0])
    stream = await asyncio.wait_for(stub.rpc_download(request), timeout=time_left(deadline))
    first = True
    try:
        while filled[0] < end:
            msg = await next_by(stream, deadline)
            if msg.error:
                raise (NotHeld if msg.error.startswith(NO_STATE) else DownloadError)(f"donor says: {msg.error}")
            if first:  # (every answer's first chunk carries the header)
                got.check_header(msg)
                first = False
            at, n = filled[0], len(msg.g) // 4
            if (msg.fragment != fragment or msg.offset != at or n == 0 or n > max_chunk_elems
                    or len(msg.g) != 4 * n or len(msg.v) != 4 * n or at + n > end):
                raise DonorLied(f"malformed chunk at offset {msg.offset} ({len(msg.g)} bytes)")
            got.G[at:at + n] = torch.from_numpy(np.frombuffer(msg.g, dtype="<f4").astype(np.float32))
            got.v[at:at + n] = torch.from_numpy(np.frombuffer(msg.v, dtype="<f4").astype(np.float32))
            filled[0] = at + n
            got.received += msg.ByteSize()
            await pacer.take(msg.ByteSize())
    finally:
        await stream.aclose()
    # hashing a part takes a while (a 1B model's fragment: seconds): off the event loop, which runs our rounds
    await asyncio.get_running_loop().run_in_executor(None, got.verify, start, end)


def _parts(numel: int, pieces: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of whole digest blocks covering ``numel`` elements, about ``pieces`` of them."""
    blocks = math.ceil(numel / DIGEST_BLOCK)
    per = max(1, math.ceil(blocks / max(1, pieces))) * DIGEST_BLOCK
    return [(start, min(numel, start + per)) for start in range(0, numel, per)]


async def download(p2p: P2P, donors: Sequence[PeerID], fragment: int, *, round_: int, numel: int, digest: str,
                   timeout_per_donor: Union[float, Mapping[PeerID, float]], max_chunk_elems: int,
                   pacer: Optional[Pacer] = None, parallel: int = 3,
                   on_sample: Optional[Callable[[int, float], None]] = None,
                   on_lie: Optional[Callable[[str, str], object]] = None,
                   on_unheld: Optional[Callable[[str], object]] = None,
                   on_failed: Optional[Callable[[str], object]] = None,
                   on_served: Optional[Callable[[str], object]] = None) -> ServedState:
    """Downloads round ``round_`` of fragment ``fragment`` (``numel`` elements, ``digest``) from up to
    ``parallel`` of ``donors`` at once, part by part, each part verified; a donor that fails a part (dead, slow,
    busy, lying) is dropped and its part goes to the next. Each donor in use gets ``timeout_per_donor`` seconds
    for its parts (a mapping: per donor, e.g. from its declared uplink, peer/net/flow/links.py). ``pacer``: the
    owner's download cap (the donors in use are each declared a share of it). ``on_sample(bytes, seconds)``: what
    came in how long, also when the download fails (the next one's deadlines can then fit the link).
    ``on_lie(donor, why)``: a donor sent what no honest one sends (:class:`DonorLied`); ``on_unheld(donor)``: one
    said it holds no such state (:class:`NotHeld`); ``on_failed(donor)``: one failed for another reason (busy, an
    error answer, a stream that ended twice, its deadline: not a lie, but a record that advertises a state its peer
    never delivers must not stay a vote, :meth:`~peer.net.view.roster.Roster.donor_failed`); ``on_served(donor)``:
    one delivered a verified part (once per donor).
    Raises :class:`DownloadError` when the donors run out before every part is in."""
    pacer = pacer or Pacer(lambda: 0.0)
    width = max(1, min(parallel, len(donors)))
    got = _Assembly(numel, digest, torch.empty(numel), torch.empty(numel), _parts(numel, PARTS_PER_DONOR * width),
                    want_round=round_)
    total = len(got.parts)
    waiting = list(donors)  # donors not yet used
    errors: list[str] = []

    changed = asyncio.Event()  # a part came back or was verified: idle donors look again
    served: set[PeerID] = set()  # donors that delivered a verified part

    async def worker(donor: PeerID) -> None:
        deadline = time.monotonic() + (timeout_per_donor[donor] if isinstance(timeout_per_donor, Mapping)
                                       else timeout_per_donor)
        cut_short = False  # a stream of this donor's ended before its part did (forgiven once)
        while got.done < total:
            if not got.parts:  # every part is taken: wait in case one comes back (its donor failed)
                changed.clear()
                await changed.wait()
                continue
            part = got.parts.pop(0)
            filled = [part[0]]  # the part's elements before filled[0] are in, from this donor
            try:
                while True:
                    try:
                        await _fetch(p2p, donor, fragment, round_, part, got, deadline, max_chunk_elems, pacer,
                                     share(pacer.rate(), width), filled)
                        break
                    except StopAsyncIteration:
                        if cut_short or time.monotonic() >= deadline:
                            raise
                        # the stream ended without a word from the donor (the transport closed it): ask it once
                        # more, for the rest of the part only (what came is kept: the same donor's, verified whole)
                        cut_short = True
                        log.info("state download of fragment %d from %s: a stream ended early at element %d of "
                                 "[%d, %d); asking again for the rest", fragment, short_id(donor), filled[0], *part)
                got.done += 1
                changed.set()
                if donor not in served:
                    served.add(donor)
                    if on_served is not None:
                        on_served(str(donor))
            except Exception as e:  # a dead, slow, busy or lying donor: its part goes to the next one, whole
                got.parts.insert(0, part)
                changed.set()
                log.warning("state download of fragment %d from %s failed: %s: %s", fragment, short_id(donor),
                            type(e).__name__, e)
                errors.append(f"{short_id(donor)}: {type(e).__name__}")
                if isinstance(e, DonorLied) and on_lie is not None:
                    on_lie(str(donor), str(e))
                if isinstance(e, NotHeld) and on_unheld is not None:
                    on_unheld(str(donor))
                elif not isinstance(e, (DonorLied, NotHeld)) and on_failed is not None:
                    on_failed(str(donor))
                if waiting:  # a fresh donor takes this one's place
                    spawn(waiting.pop(0))
                return

    tasks: set[asyncio.Task] = set()

    def spawn(donor: PeerID) -> None:
        tasks.add(asyncio.ensure_future(worker(donor)))

    for _ in range(width):
        spawn(waiting.pop(0))
    started = time.monotonic()
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            tasks -= done
    finally:
        for task in tasks:
            task.cancel()
        if on_sample is not None and got.received:
            on_sample(got.received, time.monotonic() - started)
    if got.done < total or got.blocks is None:
        tried = "; ".join(errors) or "no donors"
        raise DownloadError(f"fragment {fragment}: no donor delivered a verified state ({tried})")
    return ServedState(fragment, got.round, got.step, got.G, got.v, digest, got.blocks)
