"""The reducer's side of one group's round as data: the parts of our span that came in, combined once.

:class:`SpanReduction` is what :class:`~peer.net.round.reducer.AllReduceServicer` fills from the members' streams and
what :func:`~peer.net.round.allreduce.run_allreduce` reads our own span from; the pieces' encoding and checked decoding
are shared by both directions of the stream. No networking here: the RPC runners are :mod:`peer.net.round.reducer` and
:mod:`peer.net.round.allreduce`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Container, Optional

import torch

from peer.net.trust.exclusion import Offence, PeerVerdict
from peer.net.round.group import GroupPlan
from peer.net.trust.claims import ClaimBook
from peer.net.trust.span_proofs import SpanSigner, span_digest
from peer.outer.aggregate import aggregate
from peer.outer.codec import Codec, CodecError, encode_span
from peer.proto import allreduce_pb2 as pb
from peer.proto import codec_pb2
from peer.util import short_id, time_left

log = logging.getLogger(__name__)
Status = pb.ReduceResponse.Status
Pieces = list[tuple[int, codec_pb2.EncodedTensor]]  # (element offset within a span, encoded piece), in order


@dataclass
class Traffic:
    """Protocol bytes this peer sent/received for one all-reduce (serialized message sizes)."""

    sent: int = 0
    received: int = 0


@dataclass
class Lifted:
    """What a two-level round's level 2 made of our span (peer/net/round/levels.py): the pieces to forward unchanged
    (they tile the span) and the total weight behind them."""

    pieces: Pieces
    total_weight: float
    traffic: Traffic = field(default_factory=Traffic)  # level 2's bytes, counted with the round's


# Level 2 of a two-level round: (our group's combined span, its total weight) -> Lifted; raises LiftError.
Lift = Callable[[torch.Tensor, float], Awaitable[Lifted]]


class LiftError(Exception):
    """Level 2 did not give our whole span (a slot's level-2 span missing, its group rejected): our span fails for
    our group (missing, not applied)."""


def encode_pieces(codec: Codec, values: torch.Tensor, chunk_elems: int) -> Pieces:
    """Cuts a flat vector into (offset, EncodedTensor) pieces of at most ``chunk_elems`` elements."""
    step = max(codec.block_size, chunk_elems - chunk_elems % codec.block_size)
    return list(zip(range(0, values.numel(), step), encode_span(codec, values, step)))


def decode_piece(codec: Codec, piece, offset: int, filled: int, out: torch.Tensor) -> int:
    """Decodes one streamed piece into ``out`` (the span's fp32 buffer, filled up to ``filled``) after checking
    that it continues the span exactly there; returns the elements it added."""
    length = out.numel()
    if offset != filled or piece.numel == 0 or filled + piece.numel > length:
        raise CodecError(f"piece [{offset}, {offset + piece.numel}) does not continue [0, {filled}) of {length}")
    if piece.codec != codec.name or piece.codec_version != codec.version:
        raise CodecError(f"piece uses codec {piece.codec} v{piece.codec_version}, group uses {codec.name}")
    codec.decode_flat(piece, out=out[filled:filled + piece.numel])  # (finite values, or CodecError)
    return piece.numel


class SpanReduction:
    """Reducer-side state of one group: collects members' parts of our span, combines them once. Changed only
    through its methods (the servicer's streams call :meth:`stream_opened`, :meth:`claimed`, :meth:`received`,
    :meth:`add`, :meth:`give_up_on` and :meth:`stream_closed`), on the event loop that serves them. The combination
    and its encoding run on a worker thread (a fragment's span takes the CPU for a second at 1B scale, which must not
    stall the loop's streams and heartbeats): the parts are closed first, so nothing it reads changes meanwhile.
    :attr:`seen` (what our own member side received of every span, for the reducer to send each member after its
    average) is written once, by :meth:`publish_seen`."""

    def __init__(self, plan: GroupPlan, part_timeout: float, chunk_elems: int,
                 excluded: Container[object] = frozenset(), lift: Optional[Lift] = None,
                 signer: Optional[SpanSigner] = None, claims: Optional[ClaimBook] = None):
        """``excluded``: the peers this peer no longer works with (read only: the swarm's ledger); ``lift``: a
        two-level round's level 2 (peer/net/round/levels.py); the pieces it returns are sent instead of our own
        encoding of the combined parts; ``signer``: signs our average (None: unsigned, which members refuse);
        ``claims``: the members' claims for the group (peer/net/trust/claims.py) that our member side counts, which
        the parts' headers add to and which we relay with our list (None: a level-2 round, which claims nothing)."""
        self.signer, self.claims = signer, claims
        self.seen: asyncio.Future[list[pb.SpanSeen]] = asyncio.get_running_loop().create_future()
        self.plan = plan
        self.lift = lift
        self.excluded = excluded
        # parts we wait for: an excluded member's part is refused, so waiting for it would cost part_timeout
        self.expected = sum(peer not in excluded for peer in plan.peer_ids)
        self.verdicts: list[PeerVerdict] = []  # offences of members seen here, for the round to hand on
        start, end = plan.spans[plan.my_index]
        self.length = end - start
        self.parts: dict[int, tuple[float, torch.Tensor]] = {}  # member index -> (declared weight, part)
        self.closed = False  # the parts are in or their deadline passed: no more are added
        self.gone: set[int] = set()  # members whose stream ended without their whole part: not waited for
        self.total_weight = 0.0
        self.flagged: list[tuple[str, str]] = []  # (peer id, why) of parts clipped or capped by the rule
        self.all_in = asyncio.Event()
        self.deadline = time.monotonic() + part_timeout
        self.chunk_elems = chunk_elems
        self.traffic = Traffic()  # parts received here, and level 2's bytes; our averages are in sent_bytes()
        self.requesters: set[int] = set()
        self.serving: set[int] = set()  # members whose rpc_reduce stream is still open
        self.idle = asyncio.Event()  # set while no member stream is open
        self.idle.set()
        self.result = asyncio.ensure_future(self._finalize())

    def sent_bytes(self) -> int:
        """Bytes of the encoded average times the remote members that asked for it."""
        if not self.result.done() or self.result.exception() is not None:
            return 0
        remote = self.requesters - {self.plan.my_index}
        return len(remote) * sum(r.ByteSize() for r in self.result.result())

    def publish_seen(self, seen: list[pb.SpanSeen]) -> None:
        """What our member side received of every span (span order): sent to each member after our average."""
        if not self.seen.done():
            self.seen.set_result(seen)

    def claimed(self, index: int, claim: pb.MemberClaim) -> None:
        """Member ``index`` sent its claim for the group with its part (kept if valid)."""
        if self.claims is not None and claim.signature:
            self.claims.add(index, claim)

    def relayed_claims(self) -> list[pb.MemberClaim]:
        """The claims we relay to each member with our list (:meth:`publish_seen`)."""
        return [] if self.claims is None else self.claims.wire()

    def stream_opened(self, index: int) -> None:
        """Member ``index`` opened its stream to us: it will ask for our average; we are not idle until it closes."""
        self.requesters.add(index)
        self.serving.add(index)
        self.idle.clear()

    def received(self, nbytes: int) -> None:
        """``nbytes`` of a member's part arrived."""
        self.traffic.received += nbytes

    def stream_closed(self, index: int) -> None:
        """Member ``index``'s stream ended (whatever the outcome)."""
        self.serving.discard(index)
        if not self.serving:
            self.idle.set()

    def offence(self, index: int, offence: Offence, detail: str) -> None:
        """Member ``index`` committed ``offence`` (``detail`` says what). Kept as a verdict: the ledger counts it
        when the round hands its verdicts to the swarm (``AllReduceResult.verdicts``); one seen after that (a part
        after our round ended, refused anyway) is not counted."""
        self.verdicts.append(PeerVerdict(str(self.plan.peer_ids[index]), f"{self.plan.label}: {detail}", offence))

    def add(self, index: int, weight: float, part: torch.Tensor) -> bool:
        """Adds a member's complete, decoded part; False if it came too late or twice."""
        if self.closed or index in self.parts:
            return False
        self.parts[index] = (weight, part)
        self._check_all_in()
        return True

    def give_up_on(self, index: int) -> None:
        """Member ``index``'s stream ended without its whole part (it died, its link broke, or it sent garbage):
        a member sends its part once, so the reduction stops waiting for it rather than for ``part_timeout``
        (the survivors of a crash then end the round together, not ``part_timeout`` apart)."""
        if index not in self.parts:
            self.gone.add(index)
            self._check_all_in()

    def _check_all_in(self) -> None:
        if len(self.parts) + len(self.gone) >= self.expected:
            self.all_in.set()

    @property
    def contributors(self) -> list[int]:
        return sorted(self.parts)

    async def _combine(self) -> torch.Tensor:
        """The parts combined by the plan's rule, in member order (deterministic), on a worker thread; reports
        what it clipped. Must be called once the parts are closed."""
        order = self.contributors
        out = await asyncio.get_running_loop().run_in_executor(
            None, aggregate, [self.parts[i][1] for i in order], [self.parts[i][0] for i in order], self.plan.rule,
            [self.plan.caps[i] for i in order] if self.plan.caps else None)
        self.total_weight = out.total_weight
        for k, i in enumerate(order):
            why = out.limited(k, self.parts[i][0])
            if why:
                peer = str(self.plan.peer_ids[i])
                self.flagged.append((peer, "; ".join(why)))
                if out.offending(k) and i != self.plan.my_index:
                    self.offence(i, Offence.CLIPPED, "; ".join(why))
                log.warning("%s: contribution of peer %s limited by the %s rule: %s", self.plan.label, short_id(peer),
                            self.plan.rule.kind, "; ".join(why))
        return out.value

    async def _finalize(self) -> list[pb.ReduceResponse]:
        if not self.length:  # (a client-mode member's span: no member sends a part to it, none is waited for)
            self.closed = True
            return [pb.ReduceResponse(status=Status.FAILED, error="this member reduces no span")]
        try:
            await asyncio.wait_for(self.all_in.wait(), timeout=time_left(self.deadline))
        except asyncio.TimeoutError:
            missing = sorted(set(range(len(self.plan.peer_ids))) - set(self.parts))
            log.warning("%s: reducer averages without members %s (no part within part_timeout)",
                        self.plan.label, [short_id(self.plan.peer_ids[i]) for i in missing])
        self.closed = True
        if not self.parts:
            return [pb.ReduceResponse(status=Status.FAILED, error="no parts arrived")]
        average = await self._combine()
        if self.lift is None:
            pieces = await asyncio.get_running_loop().run_in_executor(
                None, encode_pieces, self.plan.codec, average, self.chunk_elems)
        else:  # two levels: our group's combination is our part of the slots' level-2 rounds
            try:
                lifted = await self.lift(average, self.total_weight)
            except LiftError as e:
                log.warning("%s: level 2 failed, our span is not averaged: %s", self.plan.label, e)
                return [pb.ReduceResponse(status=Status.FAILED, error=f"level 2: {e}")]
            pieces, self.total_weight = lifted.pieces, lifted.total_weight
            self.traffic.sent += lifted.traffic.sent
            self.traffic.received += lifted.traffic.received
        responses = []
        for k, (offset, piece) in enumerate(pieces):
            msg = pb.ReduceResponse(status=Status.OK, offset=offset, piece=piece)
            if k == 0:
                msg.contributors.extend(self.contributors)
                msg.total_weight = self.total_weight
            responses.append(msg)
        if self.signer is not None:  # (hashing the span's bytes: on a worker thread, as the encoding)
            gid, me = self.plan.group_id, self.plan.my_index
            digest = await asyncio.get_running_loop().run_in_executor(None, span_digest, gid, me, responses)
            responses[0].signature = self.signer.sign(gid, me, digest)
        return responses
