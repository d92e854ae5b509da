"""When fragment p syncs: the steps schedule (paper) and the clock schedule (volunteer swarms).

Fragment p of P syncs after inner step t when ``(t - t_p) mod H == 0`` with ``t_p = round(p*H/P)``;
its round number is ``(t - t_p) / H`` (1, 2, ...). Some fragment syncs every ~H/P steps, each
fragment every H steps; P = 1 is DiLoCo's schedule.
"""

from __future__ import annotations

import math
from typing import Callable, Optional


def fragment_offset(p: int, num_fragments: int, H: int) -> int:
    """``t_p = round(p * H / P)``: fragment p's phase in the steps schedule."""
    return round(p * H / num_fragments)


def due_round(step: int, p: int, num_fragments: int, H: int) -> Optional[int]:
    """The round fragment p syncs at after inner step ``step`` (1-based), or None if it is not due."""
    since = step - fragment_offset(p, num_fragments, H)
    return since // H if since > 0 and since % H == 0 else None


def sync_step(p: int, round_: int, num_fragments: int, H: int) -> int:
    """The step after which fragment p launches round ``round_`` (the inverse of :func:`due_round`)."""
    return fragment_offset(p, num_fragments, H) + round_ * H


def rounds_due_by(step: int, p: int, num_fragments: int, H: int) -> int:
    """Rounds of fragment p already due by ``step`` (0 before its first sync)."""
    return max(0, (step - fragment_offset(p, num_fragments, H)) // H)


def last_sync_step(step: int, num_fragments: int, H: int) -> int:
    """The latest step ``<= step`` at which some fragment synced (0 before the first sync)."""
    return max((sync_step(p, n, num_fragments, H) for p in range(num_fragments)
                if (n := rounds_due_by(step, p, num_fragments, H)) >= 1), default=0)


def next_sync_step(step: int, num_fragments: int, H: int) -> int:
    """The next step after ``step`` at which some fragment syncs."""
    return min(fragment_offset(p, num_fragments, H) + (rounds_due_by(step, p, num_fragments, H) + 1) * H
               for p in range(num_fragments))


def rolling_copies(tau: int, H: int, num_fragments: int) -> int:
    """The device copies of ``G, v`` a rolling residency (peer/outer/device_state.py) holds at most: the rounds in
    flight (both schedules launch a fragment every ``H / P`` steps, in the order 0, 1, ..., P - 1; a round lasts
    ``tau``), the next fragment to launch, and an aggregate's new state being prepared."""
    return min(num_fragments, -(-tau * num_fragments // H) + 2)


class StepsSchedule:
    """Lockstep schedule on the local step counter (the paper's; homogeneous peers)."""

    def __init__(self, H: int, num_fragments: int):
        self.H, self.P = H, num_fragments

    def due(self, step: int, p: int) -> Optional[int]:
        return due_round(step, p, self.P, self.H)

    def describe_next(self, step: int) -> str:
        return f"@{next_sync_step(step, self.P, self.H)}"


class ClockSchedule:
    """The volunteer default: round r of fragment p starts at swarm time ``t0 + (r + p/P) * T``.

    Peers of any speed meet at the same wall-clock moments (DHT time; hivemind keeps peers within
    seconds); each contributes whatever it trained since its last sync of p. A peer starting
    mid-run adopts the current round of every fragment and first launches the next one, so it
    never contributes to a round it did not train for.
    """

    def __init__(self, round_seconds: float, num_fragments: int, *, clock: Callable[[], float],
                 origin: float = 0.0):
        """``clock``: the swarm's clock in seconds (the trainer passes hivemind's DHT time)."""
        if round_seconds <= 0:
            raise ValueError(f"round_seconds must be > 0 (got {round_seconds})")
        self.T, self.P, self.origin = round_seconds, num_fragments, origin
        self.clock = clock
        self.last = [self.current_round(p) for p in range(num_fragments)]

    def current_round(self, p: int) -> int:
        return math.floor((self.clock() - self.origin) / self.T - p / self.P)

    def due(self, step: int, p: int) -> Optional[int]:
        r = self.current_round(p)
        if r > self.last[p]:
            self.last[p] = r
            return r
        return None

    def describe_next(self, step: int) -> str:
        now = self.clock()
        starts = [self.origin + (self.last[p] + 1 + p / self.P) * self.T for p in range(self.P)]
        return f"in {max(0.0, min(starts) - now):.0f}s"
