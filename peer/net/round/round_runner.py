"""One outer round on the wire: find a group (:mod:`peer.net.round.matchmaking`), plan it (:mod:`peer.net.round.group`),
and run the butterfly all-reduce (:mod:`peer.net.round.allreduce`), with two levels when groups are bounded
(:mod:`peer.net.round.levels`).

The rules the round follows are not here: whom it waits for is :mod:`peer.net.view.attendance`'s call, when to
keep looking or give up is :mod:`peer.net.policy.consensus`'s, its deadlines are :mod:`peer.net.flow.links`'s. This
module composes them for one round from explicit inputs: what it reads of the swarm (:class:`SwarmView`, read-only), and
hands back what the round taught as data (:class:`Lesson`: whom we met, who stayed away, offences, link samples),
which the swarm applies in one place (``SwarmView.learn``). It runs on the ``swarm-net`` loop only;
:meth:`~peer.net.swarm.Swarm.run_round` is its entry point from the training thread.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional, Protocol

import torch

from peer.net.view.activity import RoundActivity, RoundStage
from peer.net.policy.agreement import our_count_holds, quorum_size
from peer.net.round.allreduce import run_allreduce
from peer.net.view.attendance import early_assembly
from peer.net.policy.consensus import laggards, nobody_coming, swarm_is_past
from peer.net.trust.claims import GROUP_ID_CHARS, ClaimBook, Entry, claim_entries, statement, two_groups
from peer.net.trust.exclusion import Offence, PeerVerdict
from peer.net.round.group import PROTOCOL_VERSION, GroupError, GroupPlan, holds_our_count
from peer.net.round.levels import Levels, plan_levels, swarm_lift
from peer.net.flow.links import plan_deadlines
from peer.net.round.matchmaking import GaveUp, LeaderWaits, form_group, round_prefix
from peer.outer.aggregate import vouched_caps
from peer.outer.rounds import RoundOutcome, RoundStatus
from peer.proto import allreduce_pb2 as pb
from peer.util import short_id

if TYPE_CHECKING:
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.utils.crypto import RSAPublicKey

    from peer.config import SwarmConfig
    from peer.net.view.attendance import Absent
    from peer.net.trust.records import ProgressRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lesson:
    """What round ``here`` taught, for the swarm to apply. ``came``: the members of the group we met (None: none);
    ``judge``: whether it tells who stayed away (a one-level round: the group, or that no group of ours assembled;
    a level of bounded groups is a subset by design), judged against ``invited`` (whom the round last waited for,
    :meth:`SwarmView.invited`); ``verdicts``: what it concluded of peers (offences, reducers
    that answered or stayed silent); ``uplink``/``downlink``: link samples of the all-reduce (``LinkMeter.observe``'s
    arguments); ``unheld``: state donors that said they hold no state their record advertised
    (:meth:`~peer.net.view.roster.Roster.unheld`: a state download's lesson), ``failed`` those that failed to deliver
    for another reason and ``served`` those that delivered (:meth:`~peer.net.view.roster.Roster.donor_failed`);
    ``waited``: (peer, seconds) a group we led waited for each peer it expected
    (:class:`~peer.net.round.matchmaking.LeaderWaits`)."""

    here: tuple[int, int]
    came: Optional[frozenset[str]] = None
    judge: bool = False
    invited: frozenset[str] = frozenset()
    verdicts: tuple[PeerVerdict, ...] = ()
    uplink: Optional[tuple] = None
    downlink: Optional[tuple] = None
    unheld: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    served: tuple[str, ...] = ()
    waited: tuple[tuple[str, float], ...] = ()


class SwarmView(Protocol):
    """What a round reads of the swarm, and where it hands its lessons (:class:`~peer.net.swarm.Swarm`). The round
    writes none of it: everything it learns goes through :meth:`learn`."""

    @property
    def cfg(self) -> "SwarmConfig": ...
    @property
    def peer_id(self) -> str: ...
    @property
    def client_mode(self) -> bool: ...
    @property
    def run_key(self) -> str: ...
    @property
    def codec(self) -> Any: ...
    @property
    def rule(self) -> Any: ...
    @property
    def policy(self) -> Any: ...
    @property
    def p2p(self) -> Any: ...
    @property
    def dht(self) -> Any: ...
    @property
    def servicer(self) -> Any: ...
    @property
    def guard(self) -> Any: ...
    @property
    def bandwidth(self) -> Any: ...

    def live_peers(self) -> dict[str, "ProgressRecord"]: ...
    def vouched_peers(self) -> dict[str, "ProgressRecord"]: ...
    def refused(self, peer: object) -> bool: ...
    def admitted(self, peer: str) -> bool: ...
    def declared_uplink(self) -> float: ...
    def vouched_speed(self, peer: str, now: float) -> Optional[float]: ...
    def allowance(self, peer: str) -> float: ...
    def invited(self, here: tuple[int, int]) -> frozenset[str]: ...
    def quorum_peers(self, invited: frozenset[str], here: tuple[int, int]) -> frozenset[str]: ...
    def learn(self, lesson: Lesson) -> list["Absent"]: ...
    async def claim(self, here: tuple[int, int], stmt: bytes) -> Optional[pb.MemberClaim]: ...
    async def witness(self, here: tuple[int, int], entries: list[Entry], keys: Mapping[str, "RSAPublicKey"]
                      ) -> Optional[list[Entry]]: ...


class RoundRunner:
    """Runs one round of one fragment with what ``swarm`` shows it. Its own state (``activity``: what it is doing,
    for the status) has one writer, itself."""

    def __init__(self, swarm: SwarmView, *, fragment: int, round_: int, inner_step: int, target_group_size: int,
                 sync_every: Optional[int]):
        """``sync_every``: the steps schedule's H (None on the clock schedule: no patience, no phase rules)."""
        self.swarm, self.cfg = swarm, swarm.cfg
        self.fragment, self.round, self.inner_step = fragment, round_, inner_step
        self.target_group_size, self.sync_every = target_group_size, sync_every
        self.here = (fragment, round_)
        self.label = f"peer {short_id(swarm.peer_id)} fragment {fragment} round {round_}"
        self.t0 = time.monotonic()
        self.patience = self.cfg.matchmaking_patience if sync_every else 0.0
        self.levels: Optional[Levels] = plan_levels(target_group_size, self.cfg.group_cap)  # None: one group
        self.activity = RoundActivity(fragment, round_, RoundStage.MATCHMAKING, self.t0 + self.cfg.matchmaking_timeout)
        self.invited: frozenset[str] = frozenset()  # whom the round last waited for (_expected), for its lesson
        self.counted: frozenset[str] = frozenset()  # the peers our quorum counts, whose number we declared
        self.base: Optional[tuple[int, str]] = None  # (round, digest) of the state this round applies to, once settled

    async def run(self, delta: torch.Tensor, weight: float,
                  base: "concurrent.futures.Future[tuple[int, str]]") -> RoundOutcome:
        """The round's outcome; never raises. Must be called on the swarm's ``swarm-net`` loop; ``delta`` (fp32
        CPU) must not be modified until it returns; ``base``: see :meth:`peer.net.swarm.Swarm.run_round`."""
        out = RoundOutcome(self.fragment, self.round, RoundStatus.FAILED)
        try:
            try:  # (tau = H: the previous round of the fragment is applied first)
                base_round, out.base = await asyncio.wait_for(asyncio.wrap_future(base),
                                                              self.cfg.matchmaking_timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                out.error = "the state this round applies to was not settled (the previous round never applied)"
                return out
            self.base = (base_round, out.base)
            group = await self._find_group(delta, weight, base_round, out.base)
            out.matchmaking_seconds = time.monotonic() - self.t0
            if group is None:
                waited = time.monotonic() - self.t0
                out.status, out.error = RoundStatus.NO_GROUP, f"no other peer came to this round within {waited:.0f} s"
                self._learn(out, Lesson(self.here, judge=not self.levels, invited=self.invited))
                return out
            await self._reduce(group, delta, weight, out)
            return out
        except GaveUp as e:
            out.status, out.error = RoundStatus(e.status), str(e)
            log.debug("%s: stopped looking for a group: %s", self.label, e)
            if out.status == RoundStatus.NO_GROUP:
                self._learn(out, Lesson(self.here, judge=not self.levels, invited=self.invited))
            return out
        except GroupError as e:
            out.error = f"group rejected: {e}"
            return out
        except Exception as e:  # never let a round crash the trainer
            log.exception("%s failed", self.label)
            out.error = f"{type(e).__name__}: {e}"
            return out
        finally:
            out.seconds = time.monotonic() - self.t0

    def _stage(self, stage: RoundStage, until: float, waiting_for: tuple[str, ...] = ()) -> None:
        self.activity = RoundActivity(self.fragment, self.round, stage, until, waiting_for)

    # ---- the search ----------------------------------------------------------------------------------------
    def _keep_waiting(self) -> bool:
        """Patience (steps schedule): a live peer's record shows it has not reached our launch step yet."""
        behind = laggards(self.swarm.live_peers(), self.swarm.peer_id, self.inner_step)
        if behind and time.monotonic() > self.t0 + self.cfg.matchmaking_timeout:  # searching past the timeout
            self._stage(RoundStage.PATIENT, self.t0 + self.cfg.matchmaking_timeout + self.patience, tuple(behind))
        return bool(behind)

    def _give_up(self) -> Optional[GaveUp]:
        """Why the search should end now (the swarm is past the round, no one is live, no one is coming)."""
        sw = self.swarm
        records = sw.live_peers()
        if late := swarm_is_past(sw.vouched_peers(), sw.peer_id, self.fragment, self.round, mine=self.base,
                                 support=records):
            return GaveUp(late, RoundStatus.BEHIND)
        if not any(pid != sw.peer_id for pid in records):  # everyone left (a clean stop, or silent for ttl)
            return GaveUp("no other peer is live any more", RoundStatus.ALONE)
        if self.sync_every and (gone := nobody_coming(records, sw.peer_id, launch_step=self.inner_step,
                                                      fragment=self.fragment, round_=self.round)):
            return GaveUp(gone, RoundStatus.NO_GROUP)
        return None

    def _expected(self) -> frozenset[str]:
        """Whom this round waits for (asked at each join request a leader receives: records change); the last
        answer is the invitation its lesson is judged by."""
        self.invited = self.swarm.invited(self.here)
        return self.invited

    async def _find_group(self, delta: torch.Tensor, weight: float, base_round: int, base: str
                          ) -> Optional["GroupInfo"]:
        sw, levels = self.swarm, self.levels
        expected = self._expected()  # whom we invite as we start (a leader's invitation is renewed at each join)
        self.counted = sw.quorum_peers(expected, self.here)
        count = len(self.counted)
        needed = self.cfg.min_group_size if levels else quorum_size(count, self.cfg.min_group_size)
        early: Callable[[], Optional[frozenset[str]]] = (
            (lambda: None) if levels else (lambda: early_assembly(self._expected(), sw.peer_id, needed)))
        target = levels.group_target if levels else self.target_group_size
        log.debug("%s: looking for a group (weight %.0f, target %d)", self.label, weight, target)
        info = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=weight, inner_step=self.inner_step,
                             client_mode=sw.client_mode, numel=delta.numel(),
                             download_bytes_per_second=sw.bandwidth.download.rate(),
                             slots=levels.slots if levels else 0, upload_bytes_per_second=sw.declared_uplink(),
                             base=base, base_round=base_round, expected=count, span_key=sw.servicer.signer.public)
        waits = LeaderWaits(sw.allowance)
        try:
            return await form_group(
                sw.p2p, sw.dht, prefix=round_prefix(sw.run_key, self.fragment, self.round),
                gather=info.SerializeToString(), target_group_size=target, min_group_size=needed,
                min_matchmaking_time=self.cfg.matchmaking_time, request_timeout=self.cfg.request_timeout,
                client_mode=sw.client_mode, timeout=self.cfg.matchmaking_timeout,
                poll=min(1.0, self.cfg.progress_period), give_up=self._give_up, keep_waiting=self._keep_waiting,
                patience=self.patience, excluded=sw.refused, guard=sw.guard, expected=early,
                acceptable=self._ours(delta.numel()), waits=None if levels else waits)
        finally:  # (whether or not a group formed: what we waited for as a leader is spent)
            if waits.waited:
                sw.learn(Lesson(self.here, waited=tuple(sorted(waits.waited.items()))))

    def _ours(self, numel: int) -> Callable[["GroupInfo"], bool]:
        """Whether an assembled group is ours to apply by our own count (one level; two-level groups are judged per
        slot at level 2): asked of a group a leader assembled for us before we join it, and of every group after."""
        return (lambda group: True) if self.levels else (lambda group: holds_our_count(group, numel, self.counted))

    # ---- the group -----------------------------------------------------------------------------------------
    def _learn(self, out: RoundOutcome, lesson: Lesson) -> None:
        """Hands ``lesson`` to the swarm; who it says stayed away goes into the outcome and the log."""
        out.absent = [(a.who, a.why) for a in self.swarm.learn(lesson)]
        for who, why in out.absent:
            log.info("%s: peer %s %s", self.label, who if who.startswith("(") else short_id(who), why)

    async def _reduce(self, group: "GroupInfo", delta: torch.Tensor, weight: float, out: RoundOutcome) -> None:
        sw = self.swarm
        out.group_size = len(group.peer_ids)
        strangers = [str(p) for p in group.peer_ids if not sw.admitted(str(p))]
        if strangers:  # (a leader with a pass that admitted a peer without one)
            raise GroupError(f"the group includes peer(s) without a valid pass: {[short_id(p) for p in strangers]}")
        now = time.monotonic()
        caps = vouched_caps([sw.vouched_speed(str(p), now) for p in group.peer_ids], sw.rule)
        plan = GroupPlan.from_group(group, sw.p2p.peer_id, sw.codec, delta.numel(), self.label, sw.rule, caps,
                                    span_sizing=self.cfg.span_sizing)
        for who, why in plan.dropped:  # (every member drops the same ones: the round goes on without them)
            log.warning("%s: member %s left out of the group: %s", self.label, short_id(who), why)
        ids = [str(pid) for pid in plan.peer_ids]
        members, verdict = frozenset(ids), plan.verdict
        # the verdict reads what members declare; we apply only a group that holds a majority of our own count too
        ours = self._ours(delta.numel())(group)
        # a dropped member neither came nor becomes a partner (partners count in every later quorum), nor does one we
        # do not count in a group that is not ours (ids that could make the next one ours)
        self._learn(out, Lesson(self.here, came=members if ours else members & self.counted, judge=not self.levels,
                                invited=self.invited,
                                verdicts=tuple(PeerVerdict(who, f"{self.label}: {why}", Offence.BAD_INFO)
                                               for who, why in plan.dropped)))
        out.group_size = len(plan.peer_ids)
        if verdict is not None:
            out.group_base = verdict.base
            # (our donors if we are off base, and the peers whose records alone can say our state is off if we apply:
            # in one level, only those we count)
            out.appliers = [ids[i] for i in verdict.appliers if self.levels or ids[i] in self.counted]
            if not verdict.quorum:  # (every member concludes the same: none reduces, none applies)
                out.status = RoundStatus.MINORITY
                out.error = (f"a group of {out.group_size} does not hold more than half of the "
                             f"{verdict.expected} peers its members expected: another group may apply this round")
                return
        deadlines = plan_deadlines(plan, sw.policy)  # the same for every member: from the group's infos
        out.deadline = deadlines.allreduce
        self._stage(RoundStage.ALLREDUCE, now + deadlines.allreduce)
        log.debug("%s: group of %d assembled, all-reduce starting (parts due in %.0f s, averages in %.0f s; the "
                  "declared links predict %.1f s)", self.label, out.group_size, deadlines.part, deadlines.allreduce,
                  deadlines.expected)
        lift = None
        if plan.slots:  # two levels: our span's level 2 ends early enough to bring its average down
            lift = swarm_lift(plan, p2p=sw.p2p, dht=sw.dht, servicer=sw.servicer, cfg=self.cfg,
                              prefix=round_prefix(sw.run_key, self.fragment, self.round),
                              live=self.target_group_size, deadline=now + deadlines.allreduce - deadlines.part / 2,
                              excluded=sw.refused, guard=sw.guard, bandwidth=sw.bandwidth,
                              learn=lambda verdicts: sw.learn(Lesson(self.here, verdicts=tuple(verdicts))))
        book, early = None, None

        def witness_early(full: ClaimBook) -> None:  # (every claim is in: the witness overlaps the all-reduce)
            nonlocal early
            early = asyncio.ensure_future(sw.witness(self.here, self._entries(plan, full), full.members()))

        if not self.levels:  # (one level: each member counts only the members whose claim for the group it holds)
            stmt = statement(sw.run_key, self.fragment, self.round, plan.group_id)
            own = await sw.claim(self.here, stmt)
            if own is None:
                log.warning("%s: we signed a claim for another group of this round before (a restart reran it): we "
                            "count in no group of it", self.label)
            witnessed = ours and plan.applies and len(base64.b64encode(plan.group_id)) <= GROUP_ID_CHARS
            book = ClaimBook(stmt, plan.peer_ids, None if own is None else (plan.my_index, own),
                             on_full=witness_early if witnessed else None)
        try:
            result = await run_allreduce(sw.p2p, sw.servicer, plan, delta, weight,
                                         part_timeout=deadlines.part, allreduce_timeout=deadlines.allreduce,
                                         connect_timeout=self.cfg.request_timeout, chunk_bytes=self.cfg.chunk_bytes,
                                         lift=lift, bandwidth=sw.bandwidth, claims=book)
            sw.learn(Lesson(self.here, uplink=result.uplink, downlink=result.downlink,
                            verdicts=tuple(result.verdicts)))
            out.spans, out.contributors, out.total_weight = result.spans, result.contributors, result.total_weight
            out.flagged = result.flagged
            out.bytes_sent, out.bytes_received = result.traffic.sent, result.traffic.received
            out.status = RoundStatus.OK if result.agreed else RoundStatus.PARTIAL
            if not ours:  # (our part went to the group, which may be honest and see more: the progress is carried)
                held, of = len(members & self.counted), len(self.counted)
                why = (f"it holds {held} of the {of} peers we count" if 2 * held <= of else
                       f"most of the {held} peers we count in it declared another base than its "
                       f"{out.group_base[:12]}")
                out.status, out.spans = RoundStatus.MINORITY, []
                out.error = f"not ours whatever its members declared: {why}; our part sent, nothing applied"
                log.info("%s: %s", self.label, out.error)
            elif not plan.applies:
                out.status = RoundStatus.OFF_BASE
                out.error = (f"our base {out.base[:12]} differs from the group's {out.group_base[:12]} (round "
                             f"{verdict.base_round if verdict else '?'}): our part counted, nothing applied")
            elif book is not None and verdict is not None and out.status == RoundStatus.OK:
                await self._witness(plan, verdict.base, book, out, early)
        finally:
            if early is not None:  # (done unless the round ended before its witness)
                early.cancel()

    def _entries(self, plan: GroupPlan, book: ClaimBook) -> list[Entry]:
        return claim_entries(self.fragment, self.round, plan.group_id, book, self.swarm.peer_id)

    async def _witness(self, plan: GroupPlan, base: str, book: ClaimBook, out: RoundOutcome,
                       early: Optional[Awaitable[Optional[list[Entry]]]]) -> None:
        """Must be called before a one-level round we would apply is handed back: publishes the claims we hold
        of its members and reads everyone's (:mod:`peer.net.trust.claims`; ``early``: that exchange, started once
        the book held every member's claim, so its entries are final), and keeps the round applied only if the
        members whose claim for this group we hold, and for no other group of the round, hold our count
        (:func:`~peer.net.policy.agreement.our_count_holds`). The swarm judges the members shown in two groups.
        Started early or not, each member's read begins after its own store ended: the order the claims rely on."""
        sw = self.swarm
        keys = book.members()
        found = None
        if early is not None:
            found = await early
        elif len(base64.b64encode(plan.group_id)) <= GROUP_ID_CHARS:  # (no published entry holds a longer id)
            found = await sw.witness(self.here, self._entries(plan, book), keys)
        if found is None:
            out.status, out.spans = RoundStatus.MINORITY, []
            out.error = "the group's claims could not be published and read back in time: nothing applied"
            log.info("%s: %s", self.label, out.error)
            return
        twice = await asyncio.get_running_loop().run_in_executor(
            None, two_groups, found, sw.run_key, self.fragment, self.round, plan.group_id, keys)
        kept = [(str(pid), info) for pid, info in zip(plan.peer_ids, plan.infos) if str(pid) in keys.keys() - twice]
        if our_count_holds([pid for pid, _ in kept], [info for _, info in kept], base, self.counted):
            return
        out.status, out.spans = RoundStatus.MINORITY, []
        named = f" ({', '.join(short_id(p) for p in sorted(twice))} claimed another group too)" if twice else ""
        out.error = (f"the members whose claim for this group we hold, and for no other group of the round, hold "
                     f"{len([p for p, _ in kept if p in self.counted])} of the {len(self.counted)} peers we count"
                     f"{named}: nothing applied")
        log.warning("%s: %s", self.label, out.error)
