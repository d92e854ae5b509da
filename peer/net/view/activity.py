"""What this peer's rounds in flight are doing: written by the swarm's networking thread, read by the status line
(:mod:`peer.run.status`) and published in the progress records (``seeking``, ``averaging``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RoundStage(enum.Enum):
    """What a round in flight is doing (for the status line)."""

    MATCHMAKING = "looking for a group"
    PATIENT = "waiting for peers behind by wall time"
    ALLREDUCE = "averaging"


@dataclass(frozen=True)
class RoundActivity:
    """One round in flight: its stage, until when at most (monotonic seconds), and, while patient, the live
    peers whose records show they have not reached it yet."""

    fragment: int
    round: int
    stage: RoundStage
    until: float
    waiting_for: tuple[str, ...] = ()
