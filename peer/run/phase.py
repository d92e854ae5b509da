"""Our phase against the swarm's, on the steps schedule: the step counter moved up to meet the swarm when we are far
behind it by wall time (:class:`PhaseKeeper`; the rule itself is :func:`peer.net.policy.consensus.realign`).

Our progress is kept when the counter moves (it is in ``S - theta``): only when our next rounds launch changes. The
step time the rule reads is the trainer's moving average, the one ``tau = auto`` reads too (``step_time``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

from hivemind.utils import get_dht_time

from peer.net.policy import consensus
from peer.outer.state import FragmentState
from peer.run.events import EventLog
from peer.util import Ema, short_id

log = logging.getLogger(__name__)
SHOWN_S = 30.0  # how long the status line says "out of phase" after the counter moved up (seconds)
# The rule's default lag is a second or more, so it is asked at most this often between steps (seconds), not after
# every step: each question reads the vouched records (0.3% of a tiny peer's training time, asked at every step)
CHECK_EVERY_S = 0.25


class PhaseKeeper:
    """Moves our step counter to the swarm's phase (:meth:`realign`) and says so. Used by the training thread only,
    its one writer; ``step_time`` is written by the trainer's loop, read here."""

    def __init__(self, swarm, events: EventLog, *, H: int, patience: float, step_time: Ema):
        """``swarm``: whose vouched records we read (:class:`~peer.net.swarm.Swarm`); ``H``: the schedule's steps
        per round; ``patience``: the swarm's matchmaking patience (a lag of half of it, at least a second, moves
        us by default)."""
        self.swarm, self.events, self.H, self.step_time = swarm, events, H, step_time
        self.default_lag = max(patience / 2, 1.0)
        self._moved: Optional[tuple[float, consensus.Realignment]] = None  # when and how we last moved up
        self._next_check = 0.0  # (monotonic) the default question is not asked again before then

    def realign(self, states: Sequence[FragmentState], step: int, min_lag_seconds: Optional[float] = None) -> int:
        """The step to continue from: ``step``, or the step just before the round the swarm's lead is at when we are
        at least ``min_lag_seconds`` behind it (default: half the patience; then asked at most every
        :data:`CHECK_EVERY_S`, else ``step`` is returned as it is). Logged and told (``realign``)."""
        if min_lag_seconds is None:
            now = time.monotonic()
            if now < self._next_check:
                return step
            self._next_check = now + CHECK_EVERY_S
        move = consensus.realign(self.swarm.vouched_peers(), self.swarm.peer_id, my_step=step,
                                 my_rounds=[st.last_applied for st in states], step_seconds=self.step_time.value,
                                 min_lag_seconds=self.default_lag if min_lag_seconds is None else min_lag_seconds,
                                 H=self.H, num_fragments=len(states), now=get_dht_time())
        if move is None:
            return step
        lag = f" (~{move.behind_steps * self.step_time.value:.0f} s)" if self.step_time.value else ""
        log.info("out of phase with the swarm: %d steps%s behind peer %s; moving to step %d to meet it at its "
                 "next round (our progress is kept)", move.behind_steps, lag, short_id(move.lead), move.step)
        self.events.emit("realign", step=step, to_step=move.step, behind_steps=move.behind_steps, lead=move.lead)
        self._moved = (time.monotonic(), move)
        return move.step

    def moved_ahead(self) -> Optional[int]:
        """Steps the last realignment moved us up, while the status line still tells it (else None)."""
        if self._moved is None or time.monotonic() - self._moved[0] >= SHOWN_S:
            return None
        return self._moved[1].behind_steps
