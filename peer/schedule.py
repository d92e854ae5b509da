"""When fragment p syncs: Streaming DiLoCo's steps schedule (pure arithmetic).

Fragment p of P syncs after inner step t when ``(t - t_p) mod H == 0`` with ``t_p = round(p*H/P)``;
its round number is ``(t - t_p) / H`` (1, 2, ...). Some fragment syncs every ~H/P steps, each
fragment every H steps; P = 1 is DiLoCo's schedule.
"""

from __future__ import annotations

from typing import Optional


def fragment_offset(p: int, num_fragments: int, H: int) -> int:
    """``t_p = round(p * H / P)``: fragment p's phase in the steps schedule."""
    return round(p * H / num_fragments)


def due_round(step: int, p: int, num_fragments: int, H: int) -> Optional[int]:
    """The round fragment p syncs at after inner step ``step`` (1-based), or None if it is not due."""
    since = step - fragment_offset(p, num_fragments, H)
    return since // H if since > 0 and since % H == 0 else None


def rounds_due_by(step: int, p: int, num_fragments: int, H: int) -> int:
    """Rounds of fragment p already due by ``step`` (0 before its first sync)."""
    return max(0, (step - fragment_offset(p, num_fragments, H)) // H)


def next_sync_step(step: int, num_fragments: int, H: int) -> int:
    """The next step after ``step`` at which some fragment syncs."""
    return min(fragment_offset(p, num_fragments, H) + (rounds_due_by(step, p, num_fragments, H) + 1) * H
               for p in range(num_fragments))
