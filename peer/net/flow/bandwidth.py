"""Upload and download caps on our own streams: the all-reduce (``rpc_reduce``: parts out, averages back) and
state transfer (``rpc_download``: the state we serve, the state we fetch).

The caps pace protocol messages, not sockets (a :class:`Pacer` per direction, in :class:`Bandwidth`). Upload: a
sender waits until its budget allows the next message. Download: reading slowly alone would not slow the link, so
the receiver declares its cap: on the all-reduce's streams it grants credit (:mod:`peer.net.flow.credit`), and a state
transfer's donor paces its stream to the rate the request declares (:func:`stream_pacer`). The DHT's records and
matchmaking's few bytes are not paced: they keep a capped peer visible and in groups.

Caps are read at every message from a callable, so a limit changed at run time (``swarm-peer limits``) is in force
from the next message on. :func:`cap_warnings` says how much slower a cap makes rounds, and the trainer warns when
that exceeds the round's deadline. See docs/architecture.md, "The owner's controls".
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Sequence

from peer.config import MBIT, MIN_MBPS

BURST_S = 0.25  # after an idle spell a pacer lets this many seconds' worth of bytes through at once
# The slowest a sender paces a stream for a receiver's declared cap (0.1 Mbit/s): a hostile peer declaring
# 1 byte/s holds a sender no longer than its deadlines allow anyway, and an honest one cannot ask for less.
MIN_RATE = MIN_MBPS * MBIT
# What crosses the link per byte of our messages: TCP/IP headers (~3.6% at a 1448-byte MSS) and libp2p's noise
# and yamux framing. The pacers run at the cap over this, so the link, not just our messages, stays within the
# cap (docs/benchmarks.md, "Bandwidth caps").
WIRE_OVERHEAD = 1.05


class Pacer:
    """Paces one direction's messages to ``rate()`` bytes per second (0 = unlimited), shared by all the streams of
    that direction. Used from one event loop (the swarm's): its budget (``_free_at``, ``total``) is written by
    :meth:`delay` only, there; what ``rate`` returns may be changed from any thread (the owner's limits)."""

    def __init__(self, rate: Callable[[], float], clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.clock = clock
        self._free_at = 0.0  # when the bytes taken so far have been paid for at the current rate
        self.total = 0  # bytes taken (for logs and tests)

    def delay(self, nbytes: int) -> float:
        """Takes ``nbytes`` from the budget and returns how many seconds the caller must wait for them (0 when the
        budget covers them now). Pure bookkeeping: :meth:`take` waits."""
        self.total += nbytes
        rate = self.rate()
        if rate <= 0:
            return 0.0
        now = self.clock()
        # A pacer idle for a while has a budget of at most BURST_S seconds of the rate, never more.
        self._free_at = max(self._free_at, now - BURST_S) + nbytes / rate
        return max(0.0, self._free_at - now)

    async def take(self, nbytes: int) -> None:
        """Waits until ``nbytes`` more fit the cap (concurrent callers queue up in call order)."""
        wait = self.delay(nbytes)
        if wait > 0:
            await asyncio.sleep(wait)


class Bandwidth:
    """The upload and download pacers of one peer. ``rates()`` returns the caps (upload, download) in bytes per
    second of the link, 0 for none: read at every message. The pacers run at the caps over ``WIRE_OVERHEAD``."""

    def __init__(self, rates: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)):
        self.rates = rates
        self.upload = Pacer(lambda: self.rates()[0] / WIRE_OVERHEAD)
        self.download = Pacer(lambda: self.rates()[1] / WIRE_OVERHEAD)


def share(declared: float, streams: int) -> float:
    """The rate one of ``streams`` senders paces its stream to for a receiver that declared ``declared`` bytes/s
    (0 = uncapped: 0). Declarations that are not finite are ignored; tiny ones count as :data:`MIN_RATE`."""
    if not (declared > 0 and math.isfinite(declared)):
        return 0.0
    return max(declared, MIN_RATE) / max(1, streams)


def stream_pacer(declared: float, streams: int) -> Pacer:
    """A pacer of one stream for a receiver's declared cap (:func:`share`; uncapped when it declared none)."""
    rate = share(declared, streams)
    return Pacer(lambda: rate)


def seconds_at(rate: float, nbytes: float) -> float:
    """Seconds that ``nbytes`` take at ``rate`` bytes per second (0 when uncapped)."""
    return nbytes / rate if rate > 0 else 0.0


def cap_warnings(rates: tuple[float, float], transfers: Sequence[tuple[str, float, float, str]]) -> list[str]:
    """What the caps ``rates`` (upload, download bytes/s) break, one line each: a transfer ``(what, bytes in one
    direction, its deadline in s, the setting of that deadline)`` that takes most of its deadline at a cap.
    Empty when they all fit."""
    lines = []
    for direction, rate in zip(("upload", "download"), rates):
        for what, nbytes, timeout, setting in transfers:
            need = seconds_at(rate, nbytes)
            if need > 0.8 * timeout:
                lines.append(f"the {direction} cap of {rate / MBIT:g} Mbit/s makes the largest fragment's {what} "
                             f"take ~{need:.0f} s, against swarm.{setting} = {timeout:g} s: raise the cap "
                             f"(limits.{direction}_mbps) or the timeout, or those rounds will fail")
    return lines
