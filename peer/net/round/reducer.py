"""The reducer's side of the butterfly all-reduce: :class:`AllReduceServicer` serves ``rpc_reduce`` for the groups this
peer reduces a span for (the member's side is :mod:`peer.net.round.allreduce`; messages in protos/allreduce.proto).

A member's stream carries its part of our span (each piece checked as it is decoded:
:func:`~peer.net.round.reduction.decode_piece`), then reads our encoded average, paced by our upload cap and, where
the member declared a download cap, by its credit (:mod:`peer.net.flow.credit`). The parts go into the group's
:class:`~peer.net.round.reduction.SpanReduction`, which combines them once; what a member did wrong (a bad header or
piece) is an offence the reduction keeps as a verdict. An excluded peer's stream is refused; every stream is admitted
by the peer's :class:`~peer.net.flow.streams.StreamGuard` and ends at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Container, Optional

from hivemind.p2p import P2PContext, ServicerBase

from peer.net.flow.bandwidth import Bandwidth
from peer.net.flow.credit import CreditError, SendWindow, window
from peer.net.flow.streams import StreamGuard, drain, first_message
from peer.net.plumbing.hivemind_internals import handle_name
from peer.net.round.group import valid_weight
from peer.net.round.reduction import SpanReduction, decode_piece
from peer.net.trust.exclusion import Offence
from peer.net.trust.span_proofs import SpanSigner
from peer.outer import host_memory
from peer.outer.codec import CodecError
from peer.proto import allreduce_pb2 as pb
from peer.util import next_by, short_id, time_left

log = logging.getLogger(__name__)
Status = pb.ReduceResponse.Status
# A reducer's answer when no reduction of the group registered within registration_timeout: it is not in the group
UNKNOWN_GROUP = "unknown group"


class AllReduceServicer(ServicerBase):
    """Serves ``rpc_reduce`` for the groups this peer is currently reducing for.

    Owned by the swarm's networking thread: :meth:`register` must be called (in that event loop)
    before the group's members are told the group exists, :meth:`unregister` when the round ends.
    """

    def __init__(self, *, registration_timeout: float, part_timeout: float, stream_timeout: float,
                 guard: StreamGuard, max_pending: int = 64, excluded: Container[object] = frozenset(),
                 bandwidth: Optional[Bandwidth] = None, signer: Optional[SpanSigner] = None):
        """``part_timeout``: the longest a member's first message may take, before we know its group (the
        longest part deadline a group can have); ``stream_timeout``: the longest a member's stream may stay open
        (its part, our average, the close);
        ``guard``: this peer's bound on streams per remote peer (shared by all its handlers); ``bandwidth``: the
        owner's upload and download caps (shared with the rounds of this peer and its state transfer)."""
        self.excluded = excluded  # the peers this peer no longer works with (read only: the swarm's ledger)
        self.signer = signer or SpanSigner()  # signs our averages; its key goes in our MemberInfo (span_key)
        self.bandwidth = bandwidth or Bandwidth()
        self.guard = guard
        self.stream_timeout = stream_timeout
        self._groups: dict[bytes, SpanReduction] = {}
        self._waiters: dict[bytes, asyncio.Event] = {}
        self.registration_timeout = registration_timeout
        self.part_timeout = part_timeout
        self.max_pending = max_pending

    def register(self, reduction: SpanReduction) -> None:
        gid = reduction.plan.group_id
        self._groups[gid] = reduction
        self._waiters.pop(gid, asyncio.Event()).set()

    def unregister(self, group_id: bytes) -> None:
        self._groups.pop(group_id, None)

    async def _lookup(self, group_id: bytes) -> Optional[SpanReduction]:
        # A member may learn of the group (and call us) slightly before our own matchmaking returns.
        if group_id not in self._groups and len(self._waiters) < self.max_pending:
            event = self._waiters.setdefault(group_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout=self.registration_timeout)
            except asyncio.TimeoutError:
                self._waiters.pop(group_id, None)
        return self._groups.get(group_id)

    async def rpc_reduce(self, requests: AsyncIterator[pb.ReduceRequest],
                         context: P2PContext) -> AsyncIterator[pb.ReduceResponse]:
        with self.guard.admit(str(context.remote_id), self.stream_timeout) as refusal:
            if refusal:  # (not held open: a flood of refused streams must not outlast the refusal)
                yield pb.ReduceResponse(status=Status.REJECTED, error=refusal)
                return
            refused = False
            async for response in self._reduce(requests, context):
                yield response
                refused = response.status != Status.OK
            if refused:  # held until the member, having read why, closes: closing first can drop the answer in
                await drain(requests, self.registration_timeout)  # the daemons (as in _send_average)

    async def _reduce(self, requests: AsyncIterator[pb.ReduceRequest],
                      context: P2PContext) -> AsyncIterator[pb.ReduceResponse]:
        red, sender = None, None
        opened, arrived = time.monotonic(), 0  # (the member's uplink sample: peer/net/flow/links.py)
        stream_deadline = opened + self.stream_timeout
        try:
            # The first message carries up to chunk_bytes of data: on a slow link it takes as long as
            # any other piece, so it gets the part deadline, not the (short) request timeout.
            header = await first_message(requests, self.part_timeout)
            red = await self._lookup(header.group_id)
            if red is None:
                yield pb.ReduceResponse(status=Status.REJECTED, error=UNKNOWN_GROUP)
                return
            plan = red.plan
            if context.remote_id not in plan.peer_ids:
                yield pb.ReduceResponse(status=Status.REJECTED, error="sender is not in the group")
                return
            if context.remote_id in self.excluded:
                yield pb.ReduceResponse(status=Status.REJECTED, error="sender is excluded by this peer")
                return
            sender = plan.peer_ids.index(context.remote_id)
            if header.span_index != plan.my_index or not valid_weight(header.weight):
                red.offence(sender, Offence.BAD_PART, f"span {header.span_index}, weight {header.weight}")
                yield pb.ReduceResponse(status=Status.REJECTED, error="wrong span index or invalid weight")
                return
            red.stream_opened(sender)
            red.claimed(sender, header.claim)
            # we grant credit on the part if we declared a download cap (peer/net/flow/credit.py)
            grants = window(plan.infos[plan.my_index].download_bytes_per_second, 1) > 0
            part = host_memory.empty(red.length, touch=False)  # (filled in order as the pieces arrive)
            filled, msg, read = 0, header, 0
            while True:
                filled += decode_piece(plan.parts, msg.piece, msg.offset, filled, part)
                red.received(msg.ByteSize())
                arrived += msg.ByteSize()
                await self.bandwidth.download.take(msg.ByteSize())
                if filled == red.length:
                    break
                read += 1
                if grants:
                    yield pb.ReduceResponse(acknowledged=read)
                msg = await next_by(requests, red.deadline)
            timing = (time.monotonic() - opened, arrived)
            if not red.add(sender, header.weight, part):
                log.info("%s: part from %s arrived after averaging; it is not included", plan.label,
                         short_id(context.remote_id))
            async for response in self._send_average(red, sender, requests, stream_deadline, timing):
                yield response
        except (CodecError, CreditError, asyncio.TimeoutError, StopAsyncIteration) as e:
            log.warning("rpc_reduce from %s: dropped a member's part: %s", short_id(context.remote_id),
                        type(e).__name__ + (f": {e}" if str(e) else ""))
            if red is not None and sender is not None:
                red.give_up_on(sender)
            if isinstance(e, CodecError) and red is not None and sender is not None:  # (a timeout or a closed
                red.offence(sender, Offence.BAD_PART, str(e))  # stream: the network's, no offence)
            yield pb.ReduceResponse(status=Status.REJECTED, error=f"bad or incomplete part: {type(e).__name__}",
                                    part_seconds=time.monotonic() - opened, part_bytes=arrived)
        finally:
            if red is not None and sender is not None:
                red.stream_closed(sender)

    async def _send_average(self, red: SpanReduction, member: int, requests: AsyncIterator[pb.ReduceRequest],
                            deadline: float, timing: tuple[float, int]) -> AsyncIterator[pb.ReduceResponse]:
        """Streams our encoded average to ``member``, paced by our upload cap and, when the member declared a
        download cap, by its credit (read from its request stream by a task of ours), then what our own member side
        received of every span (``red.seen``: the member checks its own against it, :mod:`peer.net.trust.span_proofs`)
        and the members' claims we hold (:mod:`peer.net.trust.claims`), then holds the stream open until the member
        closes its side: it does so only after reading all that, and closing first can drop our last message in the
        daemons (seen ~1/50). The first message tells the member how
        long its part took (``timing``: seconds, bytes). Raises :class:`CreditError` for a credit no honest member
        sends, ``asyncio.TimeoutError`` past ``deadline``."""
        responses = list(await asyncio.shield(red.result))
        first = pb.ReduceResponse()
        first.CopyFrom(responses[0])  # (the others' first message is the same but for this)
        first.part_seconds, first.part_bytes = timing
        responses[0] = first
        credit = SendWindow(window(red.plan.infos[member].download_bytes_per_second,
                                   max(r.ByteSize() for r in responses)))
        reader = asyncio.ensure_future(_read_credits(requests, credit, deadline))
        try:
            for response in responses:
                if credit.size:  # (no credit: nothing to wait for, no task per message)
                    await _first_done(credit.wait(deadline), reader)
                await self.bandwidth.upload.take(response.ByteSize())
                yield response
            if responses[0].status == Status.OK:  # then what our member side received, once it has (or gave up)
                try:
                    seen = await asyncio.wait_for(asyncio.shield(red.seen), timeout=time_left(deadline))
                except asyncio.TimeoutError:
                    pass  # (the member reads no list: it applies nothing)
                else:
                    yield pb.ReduceResponse(seen=seen, claims=red.relayed_claims())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), timeout=min(self.registration_timeout,
                                                                            time_left(deadline)))
        finally:
            reader.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # (retrieved: its error, if any, was ours to raise or is moot now)


REDUCE = handle_name(AllReduceServicer, "rpc_reduce")  # the stream a member opens to a reducer


async def _read_credits(requests: AsyncIterator[pb.ReduceRequest], credit: SendWindow, deadline: float) -> None:
    """Reads a member's stream after its part until it closes: credits only (at most one per message we send,
    :class:`SendWindow` checks the counts); anything else raises :class:`CreditError`."""
    while True:
        try:
            msg = await next_by(requests, deadline)
        except StopAsyncIteration:
            return
        if msg.HasField("piece") or msg.group_id:
            raise CreditError("a message other than a credit after the part")
        credit.grant(msg.acknowledged)


async def _first_done(wait: Awaitable[None], reader: asyncio.Future) -> None:
    """Awaits ``wait``, unless ``reader`` ends first with an error (re-raised) or cleanly (the member closed:
    no more credit will come, a ``StopAsyncIteration``)."""
    waiting = asyncio.ensure_future(wait)
    try:
        await asyncio.wait([waiting, reader], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiting.done():
            waiting.cancel()
    if waiting.done() and not waiting.cancelled():
        waiting.result()
        return
    reader.result()  # raises the reader's error
    raise StopAsyncIteration("the member closed its stream before the whole average was sent")
