"""Two-level rounds: bounded groups whose results still leave every peer on the same shared parameters.

Above ``swarm.group_cap`` live peers a round runs in two levels (:func:`plan_levels`; why, the :class:`GroupCensus`,
deadlines, failures and hostile input: docs/architecture.md, "Beyond one group"):

1. *Level 1*: groups of at most ``group_cap``; every member declares ``slots = group_cap``, so the fragment is cut
   into the same slots in every group (:func:`peer.net.round.group.slot_bounds`) and the group's reducers hold
   consecutive slots (:func:`peer.net.round.group.slot_spans`).
2. *Level 2*: a reducer combines its group's parts by the run's rule, then, per slot it holds, meets the other
   groups' holders of that slot and runs the one-level all-reduce on it (:class:`SlotLift`). Those parts are
   partial values sent in fp8; each level-2 reducer encodes its result **once** with the run's codec.
3. *Down*: the level-1 reducer forwards those bytes unchanged, so every peer of every group in a slot's level-2
   round decodes the same bytes. A slot whose level-2 round fails, or lacks a majority of the round's peers
   (:func:`~peer.net.policy.agreement.slot_verdict`; a group alone included), fails the holder's whole level-1
   span (:class:`~peer.net.round.reduction.LiftError`: missing, not applied): the groups that apply hold one digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from peer.config import SwarmConfig
from peer.net.round.allreduce import AllReduceResult, run_allreduce
from peer.net.round.reducer import AllReduceServicer
from peer.net.round.group import MAX_GROUP_SIZE, GroupError, GroupPlan, slot_bounds
from peer.net.flow.bandwidth import Bandwidth
from peer.net.flow.streams import StreamGuard
from peer.net.policy.agreement import slot_verdict
from peer.net.round.matchmaking import form_group
from peer.net.round.reduction import Lifted, LiftError, Pieces, encode_pieces
from peer.net.trust.exclusion import Offence, PeerVerdict
from peer.outer.codec import get_codec
from peer.proto import allreduce_pb2 as pb
from peer.util import time_left

log = logging.getLogger(__name__)
PART_CODEC = "fp8"  # level-2 parts: a group's combination, an intermediate value (docs/algorithm.md 6)


@dataclass(frozen=True)
class Levels:
    """How a two-level round is cut, from the live count and ``group_cap``."""

    group_target: int  # level-1 group size to aim for: groups as even as the live count allows
    groups: int  # level-1 groups expected (level 2 counts those that formed: GroupCensus)
    slots: int  # slots of the fragment (= group_cap: a group never has more reducers than slots)


def plan_levels(live: int, cap: int) -> Optional[Levels]:
    """The two-level cut for ``live`` peers with a group cap of ``cap``; None (one level, one group of all) when
    ``cap`` is 0 or ``live <= cap``."""
    if cap <= 0 or live <= cap:
        return None
    groups = math.ceil(live / cap)
    return Levels(group_target=math.ceil(live / groups), groups=groups, slots=cap)


# (slot, our serialized MemberInfo for its level 2, seconds, groups expected) -> the slot's level-2 group, None if
# no other group's holder came
FormSlot = Callable[[int, bytes, float, int], Awaitable[Optional[GroupInfo]]]
# (the slot's plan, our part of it, our weight, seconds) -> the level-2 all-reduce's result (pieces kept)
RunSlot = Callable[[GroupPlan, torch.Tensor, float, float], Awaitable[AllReduceResult]]


class SlotLift:
    """Level 2 for the slots that member ``plan.my_index`` of a two-level group holds: a
    :data:`~peer.net.round.reduction.Lift` for its :class:`~peer.net.round.reduction.SpanReduction`.

    ``deadline`` (time.monotonic) bounds everything: once ``groups()`` said how many level-1 groups to expect
    (:class:`GroupCensus`), matchmaking gets at most ``matchmaking_share`` of what is left, the level-2 all-reduce the
    rest. ``groups``, ``form`` and ``run`` do the networking (the swarm's DHT, matchmaking and all-reduce), so that
    tests can form the level-2 groups directly."""

    def __init__(self, plan: GroupPlan, *, form: FormSlot, run: RunSlot, deadline: float, chunk_elems: int,
                 groups: Callable[[], Awaitable[int]], download_bytes_per_second: float = 0.0,
                 matchmaking_share: float = 0.5, learn: Callable[[Sequence[PeerVerdict]], object] = lambda _: None):
        if not plan.slots:
            raise ValueError("a one-level plan has nothing to lift")
        self.plan = plan
        self.form, self.run, self.groups = form, run, groups
        self.deadline = deadline
        self.chunk_elems = chunk_elems  # (pieces we encode ourselves, when no other group came)
        self.download = download_bytes_per_second
        self.matchmaking_share = matchmaking_share
        self.learn = learn  # takes the offences of the level-2 members whose info the slot's plan left out

    async def __call__(self, combined: torch.Tensor, total_weight: float) -> Lifted:
        plan = self.plan
        start = plan.spans[plan.my_index][0]
        bounds = slot_bounds(plan.numel, plan.slots, plan.codec.block_size)
        slots = [s for s in plan.held[plan.my_index] if bounds[s][1] > bounds[s][0]]
        groups = await self.groups()
        results = await asyncio.gather(*[self._slot(s, combined[bounds[s][0] - start:bounds[s][1] - start],
                                                    total_weight, groups) for s in slots], return_exceptions=True)
        lifted = Lifted([], total_weight)
        totals = []
        for s, got in zip(slots, results):
            if isinstance(got, BaseException):
                raise got if isinstance(got, LiftError) else LiftError(f"slot {s}: {type(got).__name__}: {got}")
            lifted.pieces.extend((bounds[s][0] - start + offset, piece) for offset, piece in got.pieces)
            lifted.traffic.sent += got.traffic.sent
            lifted.traffic.received += got.traffic.received
            totals.append(got.total_weight)
        lifted.total_weight = min(totals, default=total_weight)
        return lifted

    def _declaration(self, part: torch.Tensor, weight: float) -> pb.MemberInfo:
        """What we declare in a slot's level 2: our level-1 group's base, expected count and size."""
        mine, verdict = self.plan.infos[self.plan.my_index], self.plan.verdict
        return pb.MemberInfo(protocol_version=mine.protocol_version, weight=weight, numel=part.numel(),
                             download_bytes_per_second=self.download,
                             base=verdict.base if verdict else mine.base,
                             base_round=verdict.base_round if verdict else mine.base_round,
                             expected=verdict.expected if verdict else mine.expected,
                             members=len(self.plan.peer_ids), span_key=mine.span_key)  # (the same servicer signs)

    async def _slot(self, slot: int, part: torch.Tensor, weight: float, groups: int) -> Lifted:
        """One slot's level 2: its group, the all-reduce, and the pieces that tile it (LiftError otherwise, and
        where the level-2 group's verdict says our group does not apply the slot)."""
        info = self._declaration(part, weight)
        group = await self.form(slot, info.SerializeToString(), time_left(self.deadline) * self.matchmaking_share,
                                groups)
        label = f"{self.plan.label} slot {slot}"
        if group is None:  # no other group's holder came: the slot holds our group's result, if we are a majority
            alone = slot_verdict([info], self.plan.slots)
            if not alone.quorum:
                raise LiftError(f"slot {slot}: no other group met us in level 2, and our {alone.counted} peers are "
                                f"not more than half of the {alone.expected} expected: nothing applied")
            log.warning("%s: no other group met us in level 2; our %d of %d peers hold the slot's average", label,
                        alone.counted, alone.expected)
            ours = await asyncio.get_running_loop().run_in_executor(None, encode_pieces, self.plan.codec, part,
                                                                    self.chunk_elems)
            return Lifted(ours, weight)
        try:
            plan = GroupPlan.from_group(group, self.plan.peer_ids[self.plan.my_index], self.plan.codec, part.numel(),
                                        label, self.plan.rule)
            if plan.slots:
                raise GroupError("a member declared slots in a level-2 group (two levels, not three)")
        except GroupError as e:
            raise LiftError(f"slot {slot}: level-2 group rejected: {e}") from None
        if plan.dropped:  # (every member drops the same ones; each names them as offenders)
            self.learn([PeerVerdict(who, f"{label}: {why}", Offence.BAD_INFO) for who, why in plan.dropped])
        verdict = slot_verdict(plan.infos, self.plan.slots)  # (every member of the slot concludes the same)
        if not verdict.quorum:
            raise LiftError(f"slot {slot}: a level-2 group of {len(plan.infos)} groups ({verdict.counted} peers) does "
                            f"not hold more than half of the {verdict.expected} expected: another may apply this round")
        plan.part_codec = get_codec(PART_CODEC)
        result = await self.run(plan, part, weight, time_left(self.deadline))
        if not result.complete or any(p is None for p in result.pieces):
            missing = [f"[{s.start}, {s.end})" for s in result.spans if s.average is None]
            raise LiftError(f"slot {slot}: level-2 spans {missing} missing")
        if plan.my_index not in verdict.appliers:  # (our part counted; our group's base is not level 2's)
            raise LiftError(f"slot {slot}: our group's base {info.base[:12]} differs from level 2's "
                            f"{verdict.base[:12]} (round {verdict.base_round}): nothing applied")
        pieces: Pieces = []
        for span, span_pieces in zip(result.spans, result.pieces):
            pieces.extend((span.start + offset, piece) for offset, piece in span_pieces or [])
        return Lifted(pieces, result.total_weight, result.traffic)


def roster_key(prefix: str) -> str:
    """The DHT key under which the reducers of a two-level round's level-1 groups announce them."""
    return f"{prefix}_groups"


def roster_sizes(found: Any, limit: int) -> list[int]:
    """The group sizes of a roster read (``dht.get(roster_key, latest=True)``; untrusted): sizes in
    ``[1, MAX_GROUP_SIZE]``, at most ``limit`` of them; anything else is skipped."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return []
    sizes = [getattr(v, "value", None) for v in entries.values()]
    return [n for n in sizes if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_GROUP_SIZE][:limit]


class GroupCensus:
    """How many level-1 groups a two-level round has, as their reducers announce them (one DHT subkey per group,
    its size): level 2's matchmaking target. Groups form up to ``matchmaking_time`` apart, and a level-2 group
    assembled before a late group's holder came would leave that group out, so :meth:`groups` reads the roster
    until its groups hold every live peer or ``cutoff`` s passed, and then counts at least ``expected`` (groups
    still forming are waited for by level 2's matchmaking, short of its target). A hostile entry can only make a
    holder wait the cutoff, or form before every group came (that group then applies nothing this round unless
    it alone holds a majority: :func:`~peer.net.policy.agreement.slot_verdict`).
    Must be used in the event loop of the swarm's networking thread."""

    def __init__(self, dht: DHT, prefix: str, *, group_id: bytes, size: int, live: int, cutoff: float,
                 request_timeout: float, ttl: float, expected: int = 1, poll: float = 0.5):
        self.dht, self.key = dht, roster_key(prefix)
        self.group_id, self.size, self.live, self.expected = group_id, size, live, expected
        self.cutoff, self.request_timeout, self.ttl, self.poll = cutoff, request_timeout, ttl, poll
        self._count: Optional[asyncio.Future] = None

    async def groups(self) -> int:
        """The number of groups (read once per round; at least ours)."""
        if self._count is None:
            self._count = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._count)

    async def _read(self) -> int:
        end = time.monotonic() + self.cutoff
        with contextlib.suppress(Exception):  # (a DHT that does not answer: the reads below say what they can)
            await asyncio.wait_for(self.dht.store(self.key, self.size, get_dht_time() + self.ttl,
                                                  subkey=self.group_id.hex(), return_future=True),
                                   self.request_timeout)
        seen = 1
        while True:
            try:
                found = await asyncio.wait_for(self.dht.get(self.key, latest=True, return_future=True),
                                               self.request_timeout)
            except Exception:
                found = None
            sizes = roster_sizes(found, self.live)
            seen = max(seen, len(sizes))
            if sum(sizes) >= self.live:
                return seen
            if time.monotonic() + self.poll >= end:
                return max(seen, self.expected)
            await asyncio.sleep(self.poll)  # (the next read: a poll of the DHT, as the heartbeat's)


def swarm_lift(plan: GroupPlan, *, p2p: P2P, dht: DHT, servicer: AllReduceServicer, cfg: SwarmConfig, prefix: str,
               live: int, deadline: float, excluded: Callable[[str], bool], guard: StreamGuard,
               bandwidth: Bandwidth, learn: Callable[[Sequence[PeerVerdict]], object]) -> SlotLift:
    """The :class:`SlotLift` of a swarm's round: level-2 groups by matchmaking under ``{prefix}_s{slot}`` (target:
    the groups of the :class:`GroupCensus`, read for at most 40% of the time to ``deadline``; short of it, whoever
    came within three quarters of the time left, at least ``cfg.matchmaking_time``; alone, the slot holds our
    group's average if our group is a majority), the all-reduce on the swarm's servicer with the round's timeouts,
    within ``deadline``. ``live``: the live peers the round was launched with; ``bandwidth``: the owner's caps;
    ``learn``: takes the level-2 all-reduces' verdicts on their reducers. Must run in the event loop that owns
    ``p2p``."""
    expected = math.ceil(live / plan.slots)  # (the groups plan_levels aims at)
    # Groups whose members came late form late: wait for the roster up to 40% of the round's time (at least
    # matchmaking_time); the slots' all-reduces need only a few seconds of what is left.
    cutoff = max(cfg.matchmaking_time, 0.4 * time_left(deadline))
    census = GroupCensus(dht, prefix, group_id=plan.group_id, size=len(plan.peer_ids), live=live, cutoff=cutoff,
                    request_timeout=cfg.request_timeout, ttl=cfg.allreduce_timeout, expected=expected)

    async def form(slot: int, gather: bytes, seconds: float, groups: int) -> Optional[GroupInfo]:
        return await form_group(p2p, dht, prefix=f"{prefix}_s{slot}", gather=gather, target_group_size=groups,
                                min_group_size=2, min_matchmaking_time=max(cfg.matchmaking_time, 0.75 * seconds),
                                request_timeout=cfg.request_timeout, client_mode=False, timeout=seconds,
                                poll=min(1.0, cfg.progress_period), excluded=excluded, guard=guard)

    async def run(slot_plan: GroupPlan, part: torch.Tensor, weight: float, seconds: float) -> AllReduceResult:
        # (measured deadlines: level 1's deadline already follows the links, level 2 gets half of what it leaves)
        parts = seconds / 2 if cfg.deadlines == "measured" else min(cfg.part_timeout, seconds / 2)
        result = await run_allreduce(p2p, servicer, slot_plan, part, weight, part_timeout=parts,
                                     allreduce_timeout=seconds, connect_timeout=cfg.request_timeout,
                                     chunk_bytes=cfg.chunk_bytes, bandwidth=bandwidth)
        learn(result.verdicts)
        return result

    return SlotLift(plan, form=form, run=run, deadline=deadline, chunk_elems=max(1, cfg.chunk_bytes // 4),
                    groups=census.groups, download_bytes_per_second=bandwidth.download.rate(), learn=learn)
