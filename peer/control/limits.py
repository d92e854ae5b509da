"""A volunteer's resource limits (pure: no networking, no torch): what share of the time the peer trains,
with how many CPU threads, and in which daily window. Set in the config (``[limits]``, ``inner.threads``)
and changed at run time through the control API (``swarm-peer limits``).

The duty cycle works as BOINC's "use at most N% of CPU time": after an inner step of ``t`` seconds the peer
rests ``t * (100 / N - 1)`` seconds, so over any stretch of steps it trains N% of the wall time. It rests
between steps only, never inside a round: the swarm's rounds and heartbeat go on while it rests.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from peer.config import MAX_MBPS, MBIT, MIN_MBPS, parse_active_hours, valid_mbps

if TYPE_CHECKING:
    from peer.proto import control_pb2 as pb

MAX_THREADS = 4096


def vram_fraction(cap_bytes: float, total_bytes: int) -> Optional[float]:
    """The share of a device of ``total_bytes`` that a cap of ``cap_bytes`` allows (torch's per-process memory
    fraction), or None when the cap does not bind (none set, or at least the whole device)."""
    if cap_bytes <= 0 or total_bytes <= 0 or cap_bytes >= total_bytes:
        return None
    return cap_bytes / total_bytes


def in_window(window: Optional[tuple[int, int]], now: datetime.datetime) -> bool:
    """Whether local time ``now`` falls in ``window`` (start inclusive, end exclusive; None = always)."""
    if window is None:
        return True
    start, end = window
    minute = now.hour * 60 + now.minute
    return start <= minute < end if start < end else (minute >= start or minute < end)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The limits in force. Validated on creation (ValueError naming the limit)."""

    duty_cycle: int = 100  # percent of wall time spent training, 1..100
    threads: int = 0  # CPU threads of the inner step (0 = torch's default)
    active_hours: str = ""  # "HH:MM-HH:MM" local time, "" = always
    upload_mbps: float = 0.0  # cap on our all-reduce and state-transfer uploads, Mbit/s (0 = none)
    download_mbps: float = 0.0  # ... and downloads

    def __post_init__(self) -> None:
        if not 1 <= self.duty_cycle <= 100:
            raise ValueError(f"duty cycle must be a percent in 1..100 (got {self.duty_cycle})")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be in 0..{MAX_THREADS} (got {self.threads})")
        parse_active_hours(self.active_hours)
        for name in ("upload_mbps", "download_mbps"):
            if not valid_mbps(getattr(self, name)):
                raise ValueError(f"{name.replace('_mbps', '')} cap must be 0 (none) or {MIN_MBPS:g}..{MAX_MBPS:g} "
                                 f"Mbit/s (got {getattr(self, name)})")

    def byte_rates(self) -> tuple[float, float]:
        """The (upload, download) caps in bytes per second, 0 for none."""
        return self.upload_mbps * MBIT, self.download_mbps * MBIT

    def rest_after(self, step_seconds: float) -> float:
        """Seconds to rest after an inner step of ``step_seconds`` to keep the duty cycle."""
        return max(0.0, step_seconds) * (100.0 / self.duty_cycle - 1.0)

    def active(self, now: Optional[datetime.datetime] = None) -> bool:
        """Whether local time ``now`` (default: the current one) is inside the active hours. (Asked at every step:
        without a window it costs nothing.)"""
        if not self.active_hours:
            return True
        return in_window(parse_active_hours(self.active_hours), now or datetime.datetime.now())


class LimitsBox:
    """The limits shared between the control API's threads (which replace them) and the training loop (which
    reads them at every step). Replacing is atomic: readers see the old limits or the new, never a mix."""

    def __init__(self, limits: Limits):
        self._limits = limits
        self._lock = threading.Lock()

    def get(self) -> Limits:
        return self._limits

    def update(self, **changes) -> Limits:
        """Replaces the named fields (None = keep); raises ValueError (nothing changed) on an invalid value."""
        with self._lock:
            new = dataclasses.replace(self._limits, **{k: v for k, v in changes.items() if v is not None})
            self._limits = new
        return new


def describe_limits(lim: pb.Limits | Limits) -> str:
    """One line for people: the duty cycle, threads, active hours and caps of ``lim`` (the control API's
    message or :class:`Limits`)."""
    def cap(mbps: float) -> str:
        return f"{mbps:g} Mbit/s" if mbps else "no cap"

    return (f"duty cycle {lim.duty_cycle}%, threads {lim.threads or 'default'}, active hours "
            f"{lim.active_hours or 'always'}, upload {cap(lim.upload_mbps)}, download {cap(lim.download_mbps)}")
