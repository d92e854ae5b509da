"""What a round's outcome changes outside the engine, once the engine applied (or missed) it, and what the shared
model's evaluation changes outside the evaluation.

A round: the state sync hears of a late, partial or off-base one (it then catches up, suspects our state or
downloads the group's result), our fragment's new state is published, the round is counted for the control API,
for ``tau = auto`` and in the ledger, and the pace watch hears of it (and says once when we do not keep the
swarm's pace). An evaluation: logged, told as an ``eval`` event and published in our progress record.
"""

from __future__ import annotations

import logging
from typing import Optional

from peer.net.swarm import Swarm
from peer.outer.fragments import Fragment
from peer.outer.rounds import RoundOutcome, RoundStatus
from peer.outer.settings import AutoTau
from peer.outer.state import FragmentState
from peer.run.catch_up import StateSync
from peer.run.evaluation import Evaluation
from peer.run.events import EventLog
from peer.run.ledger import RoundLedger
from peer.run.owner import OwnerLink
from peer.run.pace import PaceWatch

log = logging.getLogger(__name__)


class RoundReports:
    """Created by the trainer once the state sync exists; the engine calls :meth:`round` (its ``on_outcome``), the
    shared model's evaluation :meth:`evaluation`, both on the training thread. It holds no state of its own: it is
    the one writer of the ledger's counters (read by the trainer and the control API) and feeds the pace watch its
    rounds (the state sync feeds it its catch-ups, on the same thread)."""

    def __init__(self, label: str, peer_id: str, *, swarm: Swarm, sync: StateSync, owner: OwnerLink, events: EventLog,
                 ledger: RoundLedger, pace: PaceWatch, auto_tau: Optional[AutoTau]):
        """``label``: how our console lines name this peer (``peer_id``); ``auto_tau``: ``tau = auto``'s, None for
        a fixed tau."""
        self.label, self.peer_id, self.swarm, self.sync, self.owner = label, peer_id, swarm, sync, owner
        self.events = events
        self.ledger, self.pace, self.auto_tau = ledger, pace, auto_tau

    def round(self, frag: Fragment, st: FragmentState, outcome: RoundOutcome, step: int) -> None:
        """Acts on one applied (or missed) round (a late one: catch up; a partial one: our state is suspect), then
        the ledger counts and tells it."""
        if outcome.status == RoundStatus.BEHIND:  # the swarm is past it: take its state right after this step
            self.sync.note_late()
        if outcome.status == RoundStatus.PARTIAL:  # a span we did not apply: our state of it is likely the odd one
            self.sync.note_partial(frag.index)
        if outcome.status == RoundStatus.OFF_BASE:  # the group applied our part to its base: take its result
            self.sync.owe(frag.index, outcome.round, outcome.appliers)
        if outcome.status == RoundStatus.OK:  # its appliers hold our digest now: the drift check trusts them first
            self.sync.note_applied(frag.index, outcome.round, outcome.appliers)
        digest = self.sync.publish(frag, st, step)
        self.owner.count_round(str(outcome.status))
        if self.auto_tau is not None and RoundStatus(outcome.status).averaged:
            self.auto_tau.observe_round(outcome.ready_seconds or outcome.seconds)  # (the worker's part too)
        self.ledger.record(self.label, frag.index, frag.numel, outcome, step, digest)
        self.pace.round(outcome.status)
        self._tell_pace(step)

    def evaluation(self, e: Evaluation, step: int) -> None:
        """The shared model's held-out loss: logged, told and published in our progress record."""
        log.info("the shared model's held-out loss: %.4f, perplexity %.2f (%d sequences; fragments at rounds %s, "
                 "digests %s)", e.loss, e.perplexity, e.sequences, e.rounds, " ".join(d[:12] for d in e.digests))
        self.events.emit("eval", step=step, loss=e.loss, perplexity=e.perplexity, rounds=e.rounds,
                         digests=e.digests, sequences=e.sequences, tokens=e.tokens)
        self.swarm.ours.publish_eval(e.loss, e.rounds[0])

    def _tell_pace(self, step: int) -> None:
        """Says once per streak that we do not keep the swarm's pace (peer/run/pace.py): console and event."""
        if not self.pace.out_of_pace:
            return
        others = [r.upload_bytes_per_second for pid, r in self.swarm.live_peers().items() if pid != self.peer_id]
        if (why := self.pace.verdict(self.swarm.declared_uplink(), others)) is not None:
            log.warning("%s", why)
            self.events.emit("out_of_pace", step=step, reason=why)
