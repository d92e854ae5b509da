"""Receiver-granted credit on the all-reduce's streams: how a peer's download cap holds across its senders.

A receiver that only reads slowly does not slow its link (libp2p's stream windows and TCP's buffers take in
megabytes at link speed), and a cap split among the senders ahead of time leaves the link below the cap once one
finishes. So a receiver that declared a download cap (``MemberInfo.download_bytes_per_second``) acknowledges every
data message once its one download pacer has paid for it, and a sender keeps at most :func:`window`
unacknowledged messages in flight (:class:`SendWindow`): the streams still running share the whole cap.

Both directions of ``rpc_reduce`` use it (``ReduceResponse.acknowledged`` for a member's part pieces,
``ReduceRequest.acknowledged`` for the reducer's average pieces). A receiver without a declared cap grants nothing.
Hostile input: ignoring credit gains a sender nothing beyond the transport's buffers; an acknowledgement that does
not count up, or counts messages never sent, ends the stream (:class:`CreditError`); a receiver that never
acknowledges holds a sender until the round's deadline. See docs/architecture.md, "The owner's controls".
"""

from __future__ import annotations

import asyncio
import math

from peer.util import time_left

# In-flight data a sender keeps per stream, in seconds of the receiver's declared cap: enough to cover a home
# link's round trip (the acknowledgement comes back one RTT later) without a burst above the cap worth measuring.
WINDOW_S = 0.1
MIN_WINDOW = 2  # messages: one being read, one on its way


class CreditError(Exception):
    """An acknowledgement that no honest receiver sends (not counting up, or counting messages never sent)."""


def window(declared: float, message_bytes: int) -> int:
    """How many unacknowledged messages of ``message_bytes`` a sender keeps in flight to a receiver that declared
    ``declared`` bytes/s; 0 (no credit: send freely) when it declared no cap or a value that is not finite."""
    if not (declared > 0 and math.isfinite(declared)):
        return 0
    return max(MIN_WINDOW, math.ceil(declared * WINDOW_S / max(1, message_bytes)))


class SendWindow:
    """The sender's side of one stream: :meth:`wait` before sending message ``k`` (0-based), :meth:`grant` with
    every acknowledgement read. ``size`` 0: no credit, :meth:`wait` never waits. Used from one event loop
    (``swarm-net``): ``sent`` is written by the sending task (:meth:`wait`), ``acked`` by the task reading the
    acknowledgements (:meth:`grant`)."""

    def __init__(self, size: int):
        self.size = size
        self.sent = 0
        self.acked = 0
        self._changed = asyncio.Event()

    async def wait(self, deadline: float) -> None:
        """Waits until one more message fits the window, at most until ``deadline`` (``asyncio.TimeoutError``),
        then counts it as sent."""
        while self.size and self.sent >= self.acked + self.size:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), timeout=time_left(deadline))
        self.sent += 1

    def grant(self, acknowledged: int) -> None:
        """Takes the receiver's count of messages it has read; raises :class:`CreditError` for a count that does
        not go up or exceeds what was sent."""
        if not self.acked < acknowledged <= self.sent:
            raise CreditError(f"acknowledged {acknowledged} after {self.acked}, with {self.sent} sent")
        self.acked = acknowledged
        self._changed.set()
