"""Small helpers every layer shares (standard library only): deadlines, peer ids in log lines, a moving average."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from importlib import metadata
from typing import AsyncIterator, Optional, TypeVar

try:
    VERSION = metadata.version("swarmloco")  # published in the progress records (the monitor's peer list)
except metadata.PackageNotFoundError:  # a source tree that was never installed
    VERSION = "unknown"

T = TypeVar("T")


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative."""
    return max(0.0, deadline - time.monotonic())


async def next_by(stream: AsyncIterator[T], deadline: float) -> T:
    """The next message of ``stream``, or ``asyncio.TimeoutError`` at ``deadline`` (monotonic);
    ``StopAsyncIteration`` when the stream ended."""
    return await asyncio.wait_for(stream.__anext__(), timeout=time_left(deadline))


class Stopped(Exception):
    """A wait ended because the peer is stopping (:func:`result_or_stop`)."""


def result_or_stop(future: "concurrent.futures.Future[T]", timeout: float, stop: Optional[threading.Event],
                   poll: float = 0.25) -> T:
    """``future.result(timeout)``, but cancels ``future`` and raises :class:`Stopped` as soon as ``stop`` is set
    (checked every ``poll`` seconds), and cancels it before raising ``concurrent.futures.TimeoutError``: a
    blocking call into the networking thread that a Ctrl-C must not wait out."""
    deadline = time.monotonic() + timeout
    while True:
        if stop is not None and stop.is_set():
            future.cancel()
            raise Stopped("the peer is stopping")
        try:
            return future.result(timeout=min(poll, time_left(deadline)))
        except concurrent.futures.TimeoutError:
            if time.monotonic() >= deadline:
                future.cancel()
                raise


class Ema:
    """An exponential moving average: each value weighs ``smoothing``; ``value`` is None until the first."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.value: Optional[float] = None

    def observe(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.smoothing) * self.value + self.smoothing * x
        return self.value


def short_id(peer_id: object) -> str:
    """The last 8 characters of a peer id: how log lines name a peer."""
    return str(peer_id)[-8:]


def host_peak_bytes() -> int:
    """Peak resident set size of this process (Linux VmHWM), in bytes; 0 where /proc does not tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of each live thread of this process so far, by its Python name (pools' numbered workers summed
    under their prefix); empty where the platform has no per-thread clocks. Threads that ended are not in it."""
    out: dict[str, float] = {}
    if not hasattr(time, "pthread_getcpuclockid"):
        return out
    for thread in threading.enumerate():
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
        except (OSError, OverflowError):  # (it ended meanwhile)
            continue
        name = thread.name.rsplit("_", 1)[0] if thread.name.rsplit("_", 1)[-1].isdigit() else thread.name
        out[name] = round(out.get(name, 0.0) + seconds, 3)
    return out
