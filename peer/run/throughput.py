"""The training loop's throughput bookkeeping (pure: no I/O): tokens trained, tokens/s over the last log window,
seconds in inner steps and since the start, the moving average of the step time (realignment and ``tau = auto``
read it), and where the loop's wall time went (:class:`LoopParts`). The ``step`` event and the status line report
these figures; compute utilization is ``compute_seconds / (compute_seconds + blocked_seconds)`` (the engine counts
the blocked seconds).
"""

from __future__ import annotations

import time
from typing import Callable

from peer.util import Ema


class Throughput:
    """The counts of one training loop, from its start (creation or :meth:`restart`). Written by the training thread
    only (:meth:`observe` after each inner step, :meth:`lap` at each logged step); other threads read plain values."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.step_time = Ema(0.3)  # seconds per inner step (kept across restarts: the same model and device)
        self.restart()

    def restart(self) -> None:
        """Starts the counts again (the loop starts)."""
        self.started = self._clock()
        self.tokens = 0  # trained since the start
        self.compute_seconds = 0.0  # spent in inner steps since the start
        self.tokens_per_second = 0.0  # over the last window (0 until the first lap)
        self.elapsed = 0.0  # seconds from the start to the last lap
        self._window_tokens, self._window_start = 0, self.started
        self.parts = LoopParts(self._clock)  # the loop's seconds by part, from now

    def observe(self, tokens: int, seconds: float) -> None:
        """One inner step that trained ``tokens`` in ``seconds``."""
        self.tokens += tokens
        self._window_tokens += tokens
        self.compute_seconds += seconds
        self.step_time.observe(seconds)

    def lap(self) -> None:
        """Ends the window: :attr:`tokens_per_second` is its rate and :attr:`elapsed` is measured now; the next
        window starts now."""
        now = self._clock()
        self.tokens_per_second = self._window_tokens / max(now - self._window_start, 1e-9)
        self.elapsed = now - self.started
        self._window_tokens, self._window_start = 0, now


class LoopParts:
    """Where the training loop's wall time goes, by part (``step``, ``launch``, ``apply``, ...): the seconds from one
    :meth:`mark` to the next are the named part's, so the parts add up to the loop's time since the count was made
    (at the loop's start: what the ``step`` event's ``elapsed`` counts). Written by the training thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.seconds: dict[str, float] = {}
        self.last = clock()  # (the clock at the last mark)

    def mark(self, part: str) -> float:
        """The time since the last mark (or the count's start) was spent in ``part``; returns it."""
        now = self._clock()
        spent = now - self.last
        self.seconds[part] = self.seconds.get(part, 0.0) + spent
        self.last = now
        return spent
