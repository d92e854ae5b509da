"""The event core: a heapq of timed callbacks, run in time order (ties in the order they were scheduled).

Deterministic: nothing here draws random numbers, and two events at the same time run in insertion order.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(order=True)
class Event:
    time: float
    seq: int
    action: Callable[[], Any] = field(compare=False)
    label: str = field(default="", compare=False)


class EventQueue:
    """Holds future events; :meth:`run_until` pops them in (time, insertion) order and runs each action.

    An action may schedule further events (at ``now`` or later; never in the past)."""

    def __init__(self, start: float = 0.0):
        self.now = start
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self.processed = 0

    def schedule(self, time: float, action: Callable[[], Any], label: str = "") -> Event:
        if time < self.now:
            raise ValueError(f"event {label!r} at {time} is before now ({self.now})")
        event = Event(time, next(self._seq), action, label)
        heapq.heappush(self._heap, event)
        return event

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float:
        return self._heap[0].time if self._heap else float("inf")

    def run_until(self, end: float) -> int:
        """Runs every event with time <= ``end`` (including those scheduled meanwhile); returns how many ran.
        ``now`` is ``end`` afterwards."""
        ran = 0
        while self._heap and self._heap[0].time <= end:
            event = heapq.heappop(self._heap)
            self.now = event.time
            event.action()
            ran += 1
        self.now = max(self.now, end)
        self.processed += ran
        return ran
