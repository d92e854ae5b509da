"""Butterfly all-reduce of one fragment's outer gradient in its group, the member's side (:func:`run_allreduce`;
the reducer's: :class:`~peer.net.round.reducer.AllReduceServicer`; messages: protos/allreduce.proto).

1. The fragment's flat vector is cut into one span per non-client member (:func:`peer.net.round.group.member_spans`).
2. Every member streams its encoded part of span i, with its weight and claim (trust/claims.py), to reducer i.
3. Reducer i combines the parts that arrived by its deadline by the run's rule (:mod:`peer.outer.aggregate`),
   **encodes the result once** and streams those same bytes back to every member, with the contributors.
4. Every member (the reducer included) decodes those bytes: all hold bit-identical averages. A span whose reducer
   failed, or whose result fails the member's checks (:mod:`peer.net.trust.span_checks`), is ``None``: not applied.
5. Every reducer sends its members the list of what it accepted of every span, and the claims it holds; a member
   applies all spans, or the majority of them that every list holds (:func:`~peer.net.trust.span_proofs.may_apply`).

Nobody keeps ``average - own part`` or its own uncompressed span: a lossy codec cannot make peers drift apart.
Everything read is validated; messages are paced by upload caps and credit (:mod:`peer.net.flow.credit`). An
excluded reducer's span is not requested; what we find of others is returned as verdicts. docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import torch
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from peer.net.flow.bandwidth import Bandwidth
from peer.net.flow.credit import CreditError, SendWindow, window
from peer.net.flow.streams import ResponseStream, open_stream
from peer.net.trust.exclusion import Offence, PeerVerdict
from peer.net.round.group import GroupPlan
from peer.net.round.link_watch import LinkWatch
from peer.net.round.reducer import REDUCE, UNKNOWN_GROUP, AllReduceServicer
from peer.net.round.reduction import Lift, Pieces, SpanReduction, Traffic, decode_piece, encode_pieces
from peer.net.trust.claims import ClaimBook
from peer.net.trust.span_checks import disagreeing, implausible
from peer.net.trust.span_proofs import Seen, cross_check, enough_held, may_apply, signed_by, span_digest
from peer.outer import host_memory
from peer.outer.codec import CodecError
from peer.outer.rounds import Span
from peer.proto import allreduce_pb2 as pb
from peer.util import next_by, short_id, time_left

log = logging.getLogger(__name__)
Status = pb.ReduceResponse.Status


@dataclass
class AllReduceResult:
    """What one member got out of a round: a span per member (``average`` None where it failed)."""

    spans: list[Span]
    contributors: list[list[int]]
    traffic: Traffic = field(default_factory=Traffic)
    # whether the spans that arrived are applied: all of them, or those the lists agree on (span_proofs.may_apply)
    agreed: bool = False
    total_weight: float = 0.0  # the largest total weight among the spans that arrived
    flagged: list[tuple[str, str]] = field(default_factory=list)  # (peer id, why): parts our span's rule limited
    pieces: list[Optional[Pieces]] = field(default_factory=list)  # per span, the bytes it was decoded from
    # our link samples (peer/net/flow/links.py), as (bytes, seconds): of our parts, what the reducers read and the
    # longest of their times; of the averages we read, all their bytes and the window they came in
    uplink: Optional[tuple[int, float]] = None
    downlink: Optional[tuple[int, float]] = None
    # of the remote reducers (offences, answered, silent) and of the members whose parts our reduction judged
    verdicts: list[PeerVerdict] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(s.average is not None for s in self.spans)


async def _own_span(red: SpanReduction, values: torch.Tensor, weight: float) -> list[pb.ReduceResponse]:
    """Contributes our own part to our own span through the same encode/decode as remote parts (on a worker
    thread, as every codec pass over a part or an average of a round: the loop keeps serving streams)."""
    part = values
    if red.length:
        part = await asyncio.get_running_loop().run_in_executor(None, _through_codec, red, values)
    red.add(red.plan.my_index, weight, part)
    return await asyncio.shield(red.result)


def _through_codec(red: SpanReduction, values: torch.Tensor) -> torch.Tensor:
    """``values`` as a remote member's part of ``red``'s span arrives: encoded in pieces, then decoded."""
    part = host_memory.empty(red.length)
    for off, piece in encode_pieces(red.plan.parts, values, red.chunk_elems):
        red.plan.parts.decode_flat(piece, out=part[off:off + piece.numel])
    return part


async def _remote_span(p2p: P2P, plan: GroupPlan, j: int, values: torch.Tensor, weight: float,
                       chunk_elems: int, deadline: float, connect_timeout: float,
                       traffic: Traffic, bandwidth: Bandwidth, timings: list[tuple[int, float]],
                       arrivals: list[tuple[float, float, int]], lost: asyncio.Event,
                       average: asyncio.Future, averages_due: float, claims: Optional[ClaimBook]
                       ) -> Optional[list[pb.SpanSeen]]:
    """Streams our part of span j to reducer j, resolves ``average`` with its response messages (or the error
    that ended them; by ``averages_due``), then returns the list of what its member side received of every span,
    which it sends after an OK average (None if it did not come by ``deadline``), and adds the members' claims it
    relays with it to ``claims``. The part is paced by our upload cap and by reducer j's credit; we grant credit on
    its average if we declared a download cap. Appends ``(bytes, seconds)`` to ``timings`` when the reducer said
    how much of our part it read in how long (at most what we sent, in at most the time we saw pass before its
    answer), also when the part came too late; and ``(first, last, bytes)`` of the average's messages to
    ``arrivals``. The average fails with :class:`ConnectionLost` once
    ``lost`` is set (our daemon dropped its connection to reducer j: :mod:`peer.net.round.link_watch`). Never
    raises."""
    try:
        stream, acks, responses = await _read_average(p2p, plan, j, values, weight, chunk_elems, averages_due,
                                                      connect_timeout, traffic, bandwidth, timings, arrivals,
                                                      lost, deadline, claims)
    except Exception as e:
        average.set_exception(e)
        return None
    average.set_result(responses)
    seen = None
    try:
        if responses and responses[0].status == Status.OK and not lost.is_set():
            with contextlib.suppress(Exception):
                msg = await next_by(stream, deadline)
                traffic.received += msg.ByteSize()
                if not (msg.HasField("piece") or msg.contributors or msg.acknowledged or msg.status != Status.OK):
                    seen = list(msg.seen)
                    if claims is not None:
                        claims.relayed(msg.claims)
    finally:
        acks.put_nowait(None)  # lets our request stream end, then the reducer closes: read up to that EOF
        if seen is not None:  # (else nothing more is ours to read: we close first)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_drain(stream), timeout=min(5.0, time_left(deadline)))
        await stream.aclose()
    return seen


async def _read_average(p2p: P2P, plan: GroupPlan, j: int, values: torch.Tensor, weight: float,
                        chunk_elems: int, deadline: float, connect_timeout: float,
                        traffic: Traffic, bandwidth: Bandwidth, timings: list[tuple[int, float]],
                        arrivals: list[tuple[float, float, int]], lost: asyncio.Event, hold: float,
                        claims: Optional[ClaimBook] = None
                        ) -> tuple[ResponseStream, asyncio.Queue, list[pb.ReduceResponse]]:
    """:func:`_remote_span`'s part and average (by ``deadline``): the open stream (the caller closes it: after an
    error, closed here; our side of it is held open until ``hold`` at most), the queue of our credits (None ends
    our requests) and the average's messages. Our claim (in ``claims``) goes with the part's header."""
    own = claims.held.get(plan.my_index) if claims is not None else None
    pieces = await asyncio.get_running_loop().run_in_executor(None, encode_pieces, plan.parts, values, chunk_elems)
    opened = time.monotonic()
    span_length = plan.spans[j][1] - plan.spans[j][0]
    # credit (peer/net/flow/credit.py): the reducer's on our part if it declared a download cap, ours on its average
    credit = SendWindow(window(plan.infos[j].download_bytes_per_second, max(p.ByteSize() for _, p in pieces)))
    grants = window(plan.infos[plan.my_index].download_bytes_per_second, 1) > 0
    acks: asyncio.Queue[Optional[int]] = asyncio.Queue()  # our credits to send; None: we are done reading

    async def requests() -> AsyncIterator[pb.ReduceRequest]:
        with contextlib.suppress(asyncio.TimeoutError):
            for k, (offset, piece) in enumerate(pieces):
                msg = pb.ReduceRequest(offset=offset, piece=piece)
                if k == 0:
                    msg.group_id, msg.span_index, msg.weight = plan.group_id, j, weight
                    if own is not None:
                        msg.claim.CopyFrom(own)
                await credit.wait(deadline)
                traffic.sent += msg.ByteSize()
                await bandwidth.upload.take(msg.ByteSize())
                yield msg
            # End our side only once we read all we wait for (see AllReduceServicer._send_average).
            while (count := await asyncio.wait_for(acks.get(), timeout=time_left(hold))) is not None:
                yield pb.ReduceRequest(acknowledged=count)

    # Opening the stream dials the reducer: a dead one is detected here, within connect_timeout.
    try:
        stream = await asyncio.wait_for(open_stream(p2p, plan.peer_ids[j], REDUCE, requests(), pb.ReduceResponse),
                                        timeout=min(connect_timeout, time_left(deadline)))
    except ControlFailure as e:
        if "dial" in str(e):
            raise Undialable(str(e)) from e
        raise
    responses: list[pb.ReduceResponse] = []
    received = 0
    gone = asyncio.ensure_future(lost.wait())  # (one waiter for the whole span, not one per message)
    try:
        while received < span_length:
            msg = await _next_unless(stream, deadline, gone)
            traffic.received += msg.ByteSize()
            if msg.acknowledged:  # the reducer's credit for our part
                if msg.HasField("piece") or msg.status != Status.OK:
                    raise CreditError("a credit that carries more")
                credit.grant(msg.acknowledged)
                continue
            await bandwidth.download.take(msg.ByteSize())
            if not responses and msg.part_bytes and math.isfinite(msg.part_seconds):
                sent = sum(p.ByteSize() for _, p in pieces)
                timings.append((min(msg.part_bytes, sent), min(max(msg.part_seconds, 0.0), time.monotonic() - opened)))
            responses.append(msg)
            if msg.status != Status.OK:
                break
            if len(responses) == 1:
                first_at = time.monotonic()
            received += msg.piece.numel
            if grants:
                acks.put_nowait(len(responses))
        if responses and responses[0].status == Status.OK:
            arrivals.append((first_at, time.monotonic(), sum(r.ByteSize() for r in responses)))
        return stream, acks, responses
    except StopAsyncIteration:
        return stream, acks, responses
    except BaseException:
        acks.put_nowait(None)
        await stream.aclose()
        raise
    finally:
        gone.cancel()


class Undialable(ConnectionError):
    """Our daemon could not dial a member at all (it died before the round, or its host went away)."""


class ConnectionLost(TimeoutError):
    """Our daemon dropped its connection to a reducer before its average came: as good as its deadline passing."""


async def _next_unless(stream, deadline: float, gone: asyncio.Future):
    """:func:`next_by`, or :class:`ConnectionLost` as soon as ``gone`` (the wait for the connection's loss) is
    done. ``gone`` is the caller's, left running for its next message."""
    if gone.done():
        raise ConnectionLost("the connection to the reducer closed")
    nxt = asyncio.ensure_future(next_by(stream, deadline))
    try:
        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
    if nxt.cancelled():
        raise ConnectionLost("the connection to the reducer closed")
    return nxt.result()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


@dataclass
class SpanResult:
    """A reducer's answer for one span as a member reads it: the average, or why there is none."""

    average: Optional[torch.Tensor]
    contributors: list[int] = field(default_factory=list)
    why: str = ""
    total_weight: float = 0.0
    offence: bool = False  # the reducer answered, and what it sent is wrong (not the network)
    pieces: Optional[Pieces] = None  # the bytes ``average`` was decoded from (a level-1 reducer forwards them)
    kind: Offence = Offence.BAD_AVERAGE  # the offence, if ``offence``
    digest: bytes = b""  # of the average's messages, and its reducer's signature of it (span_proofs)
    signature: bytes = b""


def _span_from_responses(plan: GroupPlan, j: int, responses: list[pb.ReduceResponse]) -> SpanResult:
    """Decodes and checks a reducer's averaged span (metadata, coverage, codec, finiteness)."""
    start, end = plan.spans[j]
    if not responses or responses[0].status != Status.OK:
        return SpanResult(None, why=responses[0].error if responses else "no response")
    contributors = list(responses[0].contributors)
    total = responses[0].total_weight
    if (not contributors or len(set(contributors)) != len(contributors)
            or any(c >= len(plan.peer_ids) for c in contributors) or not (math.isfinite(total) and total > 0)):
        return SpanResult(None, why="invalid contributor list or total weight", offence=True)
    out = host_memory.empty(end - start, touch=False)  # (filled in order as the pieces arrive)
    filled = 0
    try:
        for msg in responses:
            filled += decode_piece(plan.codec, msg.piece, msg.offset, filled, out)
    except CodecError as e:
        return SpanResult(None, why=f"bad average: {e}", offence=True)
    if filled != end - start:  # (the stream ended early: the network's)
        return SpanResult(None, why=f"average covers {filled} of {end - start} elements")
    digest, signature = span_digest(plan.group_id, j, responses), responses[0].signature
    if not signed_by(plan.infos[j].span_key, plan.group_id, j, digest, signature):  # (no offence: a leader can swap
        return SpanResult(None, why="an average without its reducer's valid signature")  # a declared key)
    return SpanResult(out, contributors, "", total, pieces=[(msg.offset, msg.piece) for msg in responses],
                      digest=digest, signature=signature)


def _verdict(plan: GroupPlan, j: int, got: SpanResult, results: dict[int, SpanResult]) -> Optional[PeerVerdict]:
    """What we conclude of remote reducer ``j``: an offence (its span failed our checks), that it answered, that
    it stayed silent (no average from it, whether it timed out, refused or answered an error, while another remote
    reducer's span arrived: the network is not simply ours), or nothing. A reducer that answers every request with
    an error costs each of its rounds its span (or every span, where the others are too few to apply alone):
    threshold such rounds in a row exclude it (:meth:`~peer.net.trust.exclusion.Exclusions.silent`), as they do
    one that holds streams to the deadline."""
    peer, why = str(plan.peer_ids[j]), f"{plan.label}: {got.why}"
    if got.offence:
        return PeerVerdict(peer, why, offence=got.kind)
    if got.average is not None:
        return PeerVerdict(peer, answered=True)
    if any(r.average is not None for k, r in results.items() if k not in (j, plan.my_index)):
        return PeerVerdict(peer, why)
    return None


def _not_in_group(red: SpanReduction, j: int, answer: asyncio.Future) -> None:
    """Stops our span waiting for member ``j``'s part when its reducer said it does not know our group: it never
    learned of it (a leader listed a follower that had left, see :meth:`peer.net.round.matchmaking._Matchmaking.join`),
    so its part will not come, and waiting for it would cost the whole group ``part_timeout``. Likewise when our
    daemon could not dial it at all (:class:`Undialable`: a member killed as the group assembled)."""
    if answer.cancelled():
        return
    if isinstance(answer.exception(), Undialable):
        if j not in red.parts:
            log.info("%s: member %s cannot be dialed: its part is not waited for", red.plan.label,
                     short_id(red.plan.peer_ids[j]))
        red.give_up_on(j)
        return
    if answer.exception() is not None:
        return
    responses = answer.result()
    if responses and responses[0].status == Status.REJECTED and responses[0].error == UNKNOWN_GROUP:
        log.info("%s: member %s does not know this group (it never learned of it): its part is not waited for",
                 red.plan.label, short_id(red.plan.peer_ids[j]))
        red.give_up_on(j)


def _lost_member(red: SpanReduction, i: int) -> None:
    """Our daemon dropped its connection to member ``i``: its part will not come (or no longer completely)."""
    if i not in red.parts and not red.closed:
        log.info("%s: the connection to member %s closed: its part is not waited for", red.plan.label,
                 short_id(red.plan.peer_ids[i]))
    red.give_up_on(i)


def _cross_check(plan: GroupPlan, results: dict[int, SpanResult], mine: list[Seen], live: list[int],
                 received: dict[int, Optional[list[pb.SpanSeen]]]) -> bool:
    """Checks the lists of the reducers whose spans we hold against ``mine``
    (:func:`~peer.net.trust.span_proofs.cross_check`), marks in ``results`` what keeps the round from applying:
    a span its reducer sent in two versions (proven: an offence that excludes it at once), a reducer whose list
    lies (an offence) or did not come (as if its span had not: silence); returns whether we apply what we hold
    of the ``live`` spans (:func:`~peer.net.trust.span_proofs.may_apply`)."""
    found = cross_check(plan.group_id, [info.span_key for info in plan.infos], mine, received)
    agreed = may_apply(mine, found, live, partial=not plan.slots)
    for j, why in found.equivocated.items():
        results[j] = SpanResult(None, why=why, offence=True, kind=Offence.EQUIVOCATION)
    for k, why in found.lied.items():
        results[k] = SpanResult(None, why=f"its list of the spans it received: {why}", offence=True)
    for k in found.missing:
        if results[k].average is not None:
            results[k] = SpanResult(None, why="its list of the spans it received did not come")
    return agreed


def _check_spans(plan: GroupPlan, results: dict[int, SpanResult], delta: torch.Tensor) -> None:
    """Replaces, in ``results``, every remote span result that fails our checks (:mod:`peer.net.trust.span_checks`:
    size, then direction) by a missing one marked as the reducer's offence."""
    arrived = {j: r.average for j, r in results.items() if r.average is not None}
    for j, average in arrived.items():
        why = implausible(average, delta, list(arrived.values())) if j != plan.my_index else None
        if why:
            results[j] = SpanResult(None, why=why, offence=True)
    sane = {j: r.average for j, r in results.items() if r.average is not None}
    ours = {j: delta[plan.spans[j][0]:plan.spans[j][1]] for j in sane}
    for j, why in disagreeing(sane, ours, plan.my_index if plan.my_index in sane else None).items():
        results[j] = SpanResult(None, why=why, offence=True)


async def run_allreduce(p2p: P2P, servicer: AllReduceServicer, plan: GroupPlan, delta: torch.Tensor,
                        weight: float, *, part_timeout: float, allreduce_timeout: float,
                        connect_timeout: float, chunk_bytes: int, lift: Optional[Lift] = None,
                        bandwidth: Optional[Bandwidth] = None, claims: Optional[ClaimBook] = None
                        ) -> AllReduceResult:
    """Runs one butterfly all-reduce as member ``plan.my_index``; never raises for peer failures. ``lift``: a
    two-level round's level 2 for the span we reduce (:mod:`peer.net.round.levels`); ``bandwidth``: the owner's
    caps on our parts and the averages we read (None: uncapped); ``claims``: the members' claims for the group
    (:mod:`peer.net.trust.claims`, ours in it), which we send with our parts and which the parts and lists we read
    add to (None: we send and count none). Our span's reduction is registered on
    ``servicer``; the offences it saw and what we conclude of the other reducers are returned
    (``AllReduceResult.verdicts``), not applied.

    Must run in the event loop that owns ``servicer`` and ``p2p``. Returns within
    ``allreduce_timeout`` seconds (plus scheduling slack).
    """
    chunk_elems = max(1, chunk_bytes // 4)
    deadline = time.monotonic() + allreduce_timeout
    # the averages are due a request's time before the end: every reducer's list (one message) can still come,
    # also where one span is held to its deadline
    averages_due = deadline - min(connect_timeout, allreduce_timeout / 4)
    my_start, my_end = plan.spans[plan.my_index]
    bandwidth = bandwidth or Bandwidth()
    red = SpanReduction(plan, part_timeout, chunk_elems, servicer.excluded, lift, servicer.signer, claims)
    servicer.register(red)
    index = {str(peer): i for i, peer in enumerate(plan.peer_ids)}
    watch = LinkWatch(p2p, [peer for peer, i in index.items() if i != plan.my_index])
    watch.on_lost(lambda peer: _lost_member(red, index[peer]))
    watch.start()
    traffic = Traffic()
    timings: list[tuple[int, float]] = []  # (our part's bytes, the seconds its reducer read it in)
    arrivals: list[tuple[float, float, int]] = []  # (first, last, bytes) of each remote span's average
    try:
        tasks: list[tuple[int, asyncio.Future]] = []  # (span, its average's messages)
        lists: dict[int, asyncio.Task] = {}  # remote span -> what its reducer received of every span (or None)
        for j, (start, end) in enumerate(plan.spans):
            if end == start:
                continue
            values = delta[start:end]
            if j == plan.my_index:
                tasks.append((j, asyncio.ensure_future(_own_span(red, values, weight))))
            elif plan.peer_ids[j] in red.excluded:
                continue  # an excluded reducer: its span is missing (below), our part is not sent
            else:
                average = asyncio.get_running_loop().create_future()
                average.add_done_callback(functools.partial(_not_in_group, red, j))
                lists[j] = asyncio.ensure_future(_remote_span(p2p, plan, j, values, weight, chunk_elems, deadline,
                                                              connect_timeout, traffic, bandwidth, timings,
                                                              arrivals, watch.lost(str(plan.peer_ids[j])), average,
                                                              averages_due, claims))
                tasks.append((j, average))
        results: dict[int, SpanResult] = {}
        for j, task in tasks:
            try:
                responses = await task
                results[j] = await asyncio.get_running_loop().run_in_executor(None, _span_from_responses, plan, j,
                                                                              responses)
            except Exception as e:  # a dead reducer, or one that broke the stream: this span is missing
                results[j] = SpanResult(None, why=f"{type(e).__name__}: {e}")
        # what we received and accepted, for every member that reads our average (checked first: two members that
        # apply the same lists apply the same spans); then the lists of the reducers whose spans we hold
        await asyncio.get_running_loop().run_in_executor(None, _check_spans, plan, results, delta)
        mine = [Seen(r.digest, r.signature) if (r := results.get(j)) and r.average is not None else Seen()
                for j in range(len(plan.spans))]
        red.publish_seen([m.to_wire() for m in mine])
        live = [j for j, (a, b) in enumerate(plan.spans) if b > a]
        held = [j for j in live if mine[j].digest]
        needed = {j: task for j, task in lists.items() if j in held}
        for task in (t for j, t in lists.items() if j not in needed):
            task.cancel()  # (a list from a reducer whose span we lack says nothing we apply)
        agreed = False
        if enough_held(len(held), len(live), partial=not plan.slots):
            agreed = _cross_check(plan, results, mine, live, {j: await task for j, task in needed.items()})
            # (we apply exactly what our list says we hold: that is what the others checked)
            agreed = agreed and held == [j for j in live if (r := results.get(j)) and r.average is not None]
        else:  # (too few spans to apply any: no list is needed)
            for task in needed.values():
                task.cancel()
        await asyncio.gather(*lists.values(), return_exceptions=True)
        spans, contributors, pieces, total_weight, verdicts = [], [], [], 0.0, []
        for j, (start, end) in enumerate(plan.spans):
            if end == start:
                continue
            got = results.get(j, SpanResult(None, why="its reducer is excluded by this peer"))
            total_weight = max(total_weight, got.total_weight)
            if got.average is None:
                log.warning("%s: span %d [%d, %d) from reducer %s is missing and NOT applied: %s%s", plan.label,
                            j, start, end, short_id(plan.peer_ids[j]), got.why,
                            " (every list agrees: the others are applied)" if agreed else "")
            if j != plan.my_index and (verdict := _verdict(plan, j, got, results)) is not None:
                verdicts.append(verdict)
            spans.append(Span(start, end, got.average))
            contributors.append(got.contributors)
            pieces.append(got.pieces)
        # Our average must reach every member still reading it before we return: the caller may
        # shut the peer down right after its last round. Bounded by the round's deadline.
        if my_end > my_start:
            await asyncio.wait([red.result], timeout=time_left(deadline))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(red.idle.wait(), timeout=time_left(deadline))
        traffic.sent += red.sent_bytes() + red.traffic.sent
        traffic.received += red.traffic.received
        uplink = (sum(b for b, _ in timings), max(t for _, t in timings)) if timings else None
        downlink = (sum(b for _, _, b in arrivals), max(e for _, e, _ in arrivals) - min(s for s, _, _ in arrivals)
                    ) if arrivals else None
        return AllReduceResult(spans, contributors, traffic, agreed, total_weight, list(red.flagged), pieces,
                               uplink, downlink, verdicts + red.verdicts)
    finally:
        red.publish_seen([pb.SpanSeen() for _ in plan.spans])  # (if we failed first: we vouch for nothing)
        await watch.stop()
        asyncio.get_running_loop().call_later(time_left(deadline), servicer.unregister,
                                              plan.group_id)
