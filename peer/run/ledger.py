"""The rounds one peer has been through: counted for the status line and the control API, and told to the user,
one console line per round at most (ok rounds and repeats of the previous status at DEBUG: the status line counts
them) and a JSON ``round`` event each (peer/run/events.py)."""

from __future__ import annotations

import logging
from typing import Optional

from peer.outer.rounds import RoundOutcome, RoundStatus
from peer.run.events import EventLog

log = logging.getLogger(__name__)


class RoundLedger:
    """Created by the trainer; :meth:`record` once per round outcome, from the training thread. The counters are
    plain values (the control API's threads read them)."""

    def __init__(self, events: EventLog, *, aggregator: str):
        self.events = events  # (the trainer's: opened once the run dir is its own)
        self.aggregator = aggregator
        self.done = 0  # rounds of which at least one span was applied
        self.ok = self.total = 0  # rounds ok, rounds in all
        self.off_base = 0  # rounds our part went into while our base differed from the group's (nothing applied)
        self.bytes_up = self.bytes_down = 0
        self._last_status: Optional[RoundStatus] = None  # the previous round's (its repeats are logged at DEBUG)

    def record(self, label: str, fragment: int, numel: int, outcome: RoundOutcome, step: int, digest: str) -> int:
        """Counts and tells one round whose outcome was applied (``digest``: our state after it); returns the
        spans applied."""
        applied = sum(s.average is not None for s in outcome.applied_spans())
        self.done += applied > 0
        self.off_base += outcome.status == RoundStatus.OFF_BASE
        self.total += 1
        self.ok += outcome.status == RoundStatus.OK
        self.bytes_up += outcome.bytes_sent
        self.bytes_down += outcome.bytes_received
        msg = (f"{label} fragment {fragment} round {outcome.round}: {outcome.status}, group {outcome.group_size}, "
               f"{applied}/{len(outcome.spans)} spans applied, up {outcome.bytes_sent} B down "
               f"{outcome.bytes_received} B in {outcome.seconds:.2f}s, digest {digest[:12]}")
        msg += f" ({outcome.error})" if outcome.error else ""
        if outcome.status in (RoundStatus.PARTIAL, RoundStatus.FAILED, RoundStatus.MISSED, RoundStatus.OFF_BASE):
            log.warning(msg)
        elif outcome.status == RoundStatus.OK and self._last_status not in (None, RoundStatus.OK):
            log.info("%s: averaging with the swarm again", msg)
        elif outcome.status not in (RoundStatus.OK, self._last_status):  # a waiting state, said once
            log.info("%s; repeats are logged at DEBUG, the status line says what the peer waits for", msg)
        else:
            log.debug(msg)
        self._last_status = outcome.status
        self.events.emit("round", fragment=fragment, round=outcome.round, step=step, status=outcome.status,
                         launch_step=outcome.launch_step, numel=numel,
                         group_size=outcome.group_size, bytes_sent=outcome.bytes_sent,
                         bytes_received=outcome.bytes_received, seconds=outcome.seconds, digest=digest,
                         spans_applied=applied, spans_missing=len(outcome.spans) - applied,
                         total_weight=outcome.total_weight, contributors=outcome.contributors, error=outcome.error,
                         deadline=outcome.deadline, matchmaking_seconds=outcome.matchmaking_seconds,
                         applied=outcome.applied, base=outcome.base, group_base=outcome.group_base)
        for peer, why in outcome.absent:  # (the console line is the swarm's, in peer.net.swarm)
            self.events.emit("peer_absent", fragment=fragment, round=outcome.round, peer=peer, reason=why)
        for peer, why in outcome.flagged:  # (the console line is the reducer's warning, in peer.net.round.allreduce)
            self.events.emit("contribution_limited", fragment=fragment, round=outcome.round, peer=peer, reason=why,
                             aggregator=self.aggregator)
        return applied
