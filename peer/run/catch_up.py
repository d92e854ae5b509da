"""Our fragments' shared state against the swarm's: every version we hold is published (served to peers that
download it, its digest in our progress record), and where the swarm's majority is ahead of ours or differs,
we download theirs (the catch-up; whom to ask and why: :func:`peer.net.policy.consensus.plan_catch_up`).

The trainer owns one :class:`StateSync` and calls :meth:`StateSync.publish` after every change of a fragment's
``G, v`` (the restore, each round, an adoption), :meth:`StateSync.owe` after an ``off_base`` round (the group
applied our part to another base: we download its result from the members that applied it) and
:meth:`StateSync.catch_up` between steps.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Optional

from peer.net.policy.consensus import CatchUp, plan_catch_up, plan_owed, plausible_donor_step, step_after_catch_up
from peer.net.our_record import PAST_ROUNDS
from peer.net.state_transfer import DownloadError, ServedState
from peer.net.swarm import Swarm
from peer.outer.engine import StreamingEngine
from peer.outer.fragments import Fragment
from peer.outer.schedule import StepsSchedule
from peer.outer.state import FragmentState, digest_of_blocks
from peer.run.events import EventLog
from peer.run.pace import PaceWatch

log = logging.getLogger(__name__)
CONFIRMED_ROUNDS = PAST_ROUNDS  # rounds per fragment whose appliers we keep: as many as the drift check compares at


class StateSync:
    """Publishes our fragments' states and brings them to the swarm's. Used from the training thread only: its
    fields are written by its own methods (the trainer tells it of rounds through :meth:`note_late`,
    :meth:`note_partial` and :meth:`owe`)."""

    def __init__(self, swarm: Swarm, engine: StreamingEngine, *, events: EventLog, pace: PaceWatch,
                 stop: threading.Event, sync_every: int, on_fragment: Callable[[int, int, str, int], None],
                 show_status: Callable[[Optional[str]], None], owed_timeout: float = 10.0,
                 drift_check_period: float = 0.0, recheck_after: float = 0.0):
        """``owed_timeout``: how long a download owed after an ``off_base`` round waits for its donors' records
        (then the drift check takes over). :meth:`due` checks our state every ``drift_check_period`` seconds (0:
        never), ``recheck_after`` seconds after a check that waits for records, and at once after a late round."""
        self.swarm, self.engine, self.events, self.pace, self.stop = swarm, engine, events, pace, stop
        self.sync_every = sync_every
        self.on_fragment = on_fragment  # (fragment, round, digest, numel): the control API's view
        self.show_status = show_status
        # fragments whose last partial round left our state off the swarm's (the catch-up asks the majority)
        self._suspect: set[int] = set()
        # per fragment, {round: the other peers that applied it with us} for our last rounds applied in a group:
        # there only their records can say our state is off (consensus.plan_catch_up's ``confirmed``)
        self._confirmed: dict[int, dict[int, frozenset[str]]] = {}
        # per fragment, the digest of its state as last published: every change of G, v is published (restore,
        # rounds, adoption), so the drift check reads it here instead of hashing every fragment again
        self._digests: dict[int, str] = {}
        # a drift found whose repair waits for the holders' records to reach our round (CatchUp.wait): the trainer
        # checks again a quarter heartbeat later until it is repaired or gone, not a drift_check_period later
        self._recheck = False
        self._waiting: dict[int, int] = {}  # per fragment, our round at the last such wait said (once per round)
        # per fragment, the download an off_base round left us: (its round, the members that applied it, until when)
        self.owed: dict[int, tuple[int, list[str], float]] = {}
        self.owed_timeout = owed_timeout
        self.drift_check_period, self.recheck_after = drift_check_period, recheck_after
        self.late = False  # a round was found late (launch_gate): catch up right after this step (note_late)
        self._checked_at = time.monotonic()  # the last catch-up's end
        # whether the last catch_up adopted a snapshot: its step is the donor's at its apply, seconds behind the
        # swarm's now (the trainer then meets the swarm where it is: Trainer._catch_up)
        self.adopted = False

    def note_late(self) -> None:
        """A round of ours was ``behind`` (the swarm is past it): :meth:`due` says catch up now."""
        self.late = True

    def note_partial(self, fragment: int) -> None:
        """A round of ``fragment`` was ``partial`` (a span we did not apply): our state of it is likely the odd one,
        so the next catch-up takes any other digest the swarm holds at our round (consensus.plan_catch_up)."""
        self._suspect.add(fragment)

    def note_applied(self, fragment: int, round_: int, appliers: list[str]) -> None:
        """We applied round ``round_`` of ``fragment`` (``ok``) with ``appliers`` (the group's members whose base was
        ours, us included): they hold our digest there, which records of anyone else cannot outvote."""
        if self.swarm.peer_id not in appliers:
            return
        kept = self._confirmed.setdefault(fragment, {})
        kept[round_] = frozenset(appliers) - {self.swarm.peer_id}
        for old in sorted(kept)[:-CONFIRMED_ROUNDS]:
            del kept[old]

    def due(self) -> bool:
        """Whether the training loop should call :meth:`catch_up` now: a late round, a repair waiting for records
        (checked again ``recheck_after`` later: records are no fresher before, and a check reads every record), or
        the periodic drift check."""
        since = time.monotonic() - self._checked_at
        return (self.late or (self.recheck and since >= self.recheck_after)
                or bool(self.drift_check_period and since >= self.drift_check_period))

    @property
    def recheck(self) -> bool:
        """Whether a catch-up is waiting for records (check again a quarter heartbeat later)."""
        return self._recheck or bool(self.owed)

    def digest(self, p: int) -> str:
        """The digest of fragment ``p``'s state as last published (every change of it is published)."""
        return self._digests.get(p) or self.engine.states[p].digest()

    def owe(self, fragment: int, round_: int, appliers: list[str]) -> None:
        """Round ``round_`` of ``fragment`` was ``off_base``: download what ``appliers`` applied, once their records
        show it (within ``owed_timeout``)."""
        self.owed[fragment] = (round_, list(appliers), time.monotonic() + self.owed_timeout)

    def _owed_plans(self, records) -> dict[int, CatchUp]:
        plans = {}
        for p, (round_, appliers, until) in list(self.owed.items()):
            if self.engine.states[p].last_applied >= round_:
                del self.owed[p]  # (adopted since, or applied a later round from the group's base)
                continue
            votes = self.swarm.partner_votes({pid: rec for pid, rec in records.items() if pid in appliers})
            plan = plan_owed(votes, p, round_, appliers, f"off base at round {round_}: the group applied it to "
                                                         f"another state")
            if plan.wait and time.monotonic() > until:
                log.info("fragment %d: no record of the %d peer(s) that applied round %d shows it after %.0f s; the "
                         "drift check takes over", p, len(appliers), round_, self.owed_timeout)
                del self.owed[p]
                continue
            plans[p] = plan
        return plans

    def publish(self, frag: Fragment, st: FragmentState, step: int, *, adopted: bool = False) -> str:
        """Serves (and advertises) the fragment's shared state as it is now; returns its digest. The snapshot
        shares ``G, v`` (never written in place: see FragmentState); their block digests are served with every
        download, so donors' parts are verified block by block."""
        blocks = st.digest_blocks()
        digest = digest_of_blocks(blocks)
        self.swarm.ours.publish_snapshot(ServedState(frag.index, st.last_applied, step, st.G, st.v, digest, blocks),
                                    adopted=adopted)
        self.on_fragment(frag.index, st.last_applied, digest, frag.numel)
        self._digests[frag.index] = digest
        return digest

    def catch_up(self, step: int, *, joining: bool) -> int:
        """Downloads the fragments where the swarm's majority state is ahead of or differs from ours
        (see plan_catch_up; after a late round, :meth:`note_late`, every fragment the swarm is past, counting our
        rounds in flight, so that we rejoin with all of them at once); returns the step to continue from (steps
        schedule: the donors').
        Must be called after the step's launches and applies, so the adopted round is never re-launched."""
        engine, late = self.engine, self.late
        self.late, self._checked_at = False, time.monotonic()
        records = self.swarm.vouched_peers()  # (a joiner's too: sybil ids no daemon answers for move nothing)
        live = self.swarm.live_peers()
        expected = [engine.expected_round(p) for p in range(len(engine.states))]
        plans = plan_catch_up(records, self.swarm.peer_id, [st.last_applied for st in engine.states],
                              [self.digest(p) for p in range(len(engine.states))],
                              joining=joining, expected=expected, late=late, suspect=sorted(self._suspect),
                              my_past=self.swarm.ours.recent_digests(len(engine.states)),
                              confirmed=[self._confirmed.get(p, {}) for p in range(len(engine.states))],
                              support=live)
        owed = self._owed_plans(live)
        plans = [plan for plan in plans if plan.fragment not in owed] + list(owed.values())
        self._recheck = any(plan.wait for plan in plans if plan.fragment not in owed)
        for plan in plans:
            if plan.wait and plan.fragment not in owed and self._waiting.get(plan.fragment) != expected[plan.fragment]:
                self._waiting[plan.fragment] = expected[plan.fragment]
                log.info("fragment %d: %s; its holders' records still show round %d, before ours (%d): downloading "
                         "once they show where the holders are now", plan.fragment, plan.reason, plan.round,
                         expected[plan.fragment])
        donor_steps, took, failed = [], [], 0
        for plan in (plan for plan in plans if not plan.wait):
            frag, t0 = engine.fragments[plan.fragment], time.monotonic()
            random.shuffle(plan.donors)  # joiners spread over the donors
            self.show_status(f"catching up: downloading fragment {plan.fragment} round {plan.round}")
            try:
                snap = self.swarm.download_state(plan.fragment, plan.donors, round_=plan.round, numel=frag.numel,
                                                 digest=plan.digest, stop=self.stop)
            except DownloadError as e:
                if self.stop.is_set():  # (a Ctrl-C does not wait out a download: the loop ends next)
                    log.info("fragment %d: state download cancelled: the peer is stopping", plan.fragment)
                    break
                log.warning("fragment %d: could not catch up (%s): %s", plan.fragment, plan.reason, e)
                failed += 1
                continue
            engine.adopt(plan.fragment, snap.G, snap.v, snap.round, snap.blocks)
            self._suspect.discard(plan.fragment)
            self._confirmed.pop(plan.fragment, None)  # (a state from donors: no group of ours applied it)
            self.owed.pop(plan.fragment, None)
            donor_steps.append(plausible_donor_step(snap.step, plan.fragment, snap.round, len(engine.states),
                                                    self.sync_every))
            self.publish(frag, engine.states[plan.fragment], snap.step, adopted=True)
            log.info("fragment %d: caught up to round %d (digest %s) in %.1fs; %s", plan.fragment, snap.round,
                     snap.digest[:12], time.monotonic() - t0, plan.reason)
            self.events.emit("catch_up", fragment=plan.fragment, round=snap.round, digest=snap.digest,
                             step=snap.step, seconds=time.monotonic() - t0, reason=plan.reason)
            took.append(time.monotonic() - t0)
        if not self.stop.is_set():
            self.pace.caught_up(took, failed)
        self.adopted = bool(donor_steps)
        if isinstance(engine.schedule, StepsSchedule):
            step = step_after_catch_up(step, donor_steps, records, self.swarm.peer_id, self.sync_every)
        return step
