"""The peer's events as a feed that control clients follow (``WatchEvents``, ``swarm-peer top``): a bounded ring
of the latest JSON events; followers read from it at their own pace (pure: no networking).

A follower that falls behind by more than the ring holds skips what it missed (the feed is a view, not a record:
the JSON event log keeps every event); the training loop never waits for a follower.
"""

from __future__ import annotations

import collections
import threading
from typing import Iterator

RING = 1024  # events kept for followers (a few minutes of a busy peer)


class EventFeed:
    """Publish from any thread (the training loop); follow from others (the control API)."""

    def __init__(self, ring: int = RING):
        self._events: collections.deque[tuple[int, str]] = collections.deque(maxlen=ring)
        self._next = 0  # sequence number of the next event
        self._cond = threading.Condition()
        self.closed = False

    def publish(self, event_json: str) -> None:
        with self._cond:
            self._events.append((self._next, event_json))
            self._next += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Ends every follower (the peer stops)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def follow(self, *, backlog: int, active: "threading.Event | None" = None,
               poll_seconds: float = 1.0) -> Iterator[str]:
        """Yields up to ``backlog`` of the latest events, then each new one, until the feed is closed or ``active``
        (when given) is cleared (a client that went away). ``poll_seconds`` bounds each wait."""
        with self._cond:
            seq = max(0, self._next - max(0, backlog))
        while not self.closed and (active is None or active.is_set()):
            with self._cond:
                if seq >= self._next:
                    self._cond.wait(poll_seconds)
                batch = [e for s, e in self._events if s >= seq]
                seq = self._next
            yield from batch
