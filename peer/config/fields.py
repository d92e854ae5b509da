"""How a config field is declared and checked: :func:`setting` (its default, help and whether it is local),
:func:`check` (one line naming the key and what is allowed: :class:`ConfigError`), and the units and forms some
sections share (link speeds in Mbit/s, a daily window of active hours).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import field
from typing import Any, Callable, Optional


# peer/outer/codec.py's CODECS (a test keeps them equal); the top-k ones need outer.error_feedback
CODEC_NAMES = ("e3m0", "fp8", "bf16", "fp32", "topk32", "topk64", "topk128")
# peer/local/inner.py's OPTIMIZERS (a test keeps them equal)
INNER_OPTIMIZERS = ("adamw", "adamw8bit")
COMPILE_CHOICES = ("auto", "on", "off")  # inner.compile (peer/local/inner.py: compile_wanted)
# outer.lr / outer.momentum = auto: DiLoCo's Nesterov for the dense codecs; for the top-k ones a larger step and half
# the momentum (measured with 4 peers: docs/benchmarks.md, "The shared model, and the outer optimizer of the sparse
# codecs"): error feedback delivers a coordinate's backlog at once, which momentum 0.9 keeps pushing for rounds, and a
# coordinate one of M members sends arrives at 1/M of its value, which the larger step makes up. Half momentum rather
# than none: as good without an attacker, better against one.
DENSE_OUTER_STEP = (0.7, 0.9)
SPARSE_OUTER_STEP = (3.0, 0.5)


def auto_outer_step(codec: str) -> tuple[float, float]:
    """The outer Nesterov (lr, momentum) that ``auto`` stands for with ``codec``."""
    return SPARSE_OUTER_STEP if codec.startswith("topk") else DENSE_OUTER_STEP


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line (exit status 2)."""


def check(cond: bool, key: str, allowed: str, value: Any) -> None:
    """Raises :class:`ConfigError` naming ``key`` and what is ``allowed`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: must be {allowed} (got {value!r})")


def setting(default: Any = dataclasses.MISSING, *, help: str, local: bool = False,
            factory: Optional[Callable[[], Any]] = None) -> Any:
    """A config field: its default (or ``factory``), its ``help`` (shown by ``swarm-peer run --help``) and
    whether it is ``local``: a per-peer choice that never changes the shared computation, so it is left out
    of the run hash and may differ across the peers of one run (addresses, device, tau, ...)."""
    metadata = {"help": help, "local": local}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def default_of(cls: type, name: str) -> Any:
    """The default of config field ``name`` of section class ``cls`` (for code that must agree with it)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


MAX_MBPS = 1e6  # a terabit link: anything above is a typo
MAX_RECORD_TTL = 3600.0  # seconds: DHT nodes keep no record longer (peer/net/plumbing/dht_storage.py)
MIN_MBPS = 0.1  # below this no round of any model completes; senders never pace a stream slower (net/bandwidth)
MBIT = 1_000_000 / 8  # bytes per second in one Mbit/s (links are sold in Mbit/s)


def valid_mbps(value: float) -> bool:
    """Whether ``value`` is a bandwidth cap in Mbit/s (0 = no cap)."""
    return value == 0 or (math.isfinite(value) and MIN_MBPS <= value <= MAX_MBPS)


def parse_active_hours(text: str) -> Optional[tuple[int, int]]:
    """``"HH:MM-HH:MM"`` (local time; the window may wrap midnight) as (start, end) minutes of the day, or None
    for ``""`` (always active). Raises ValueError naming the expected form."""
    if not text:
        return None
    m = re.fullmatch(r"([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)", text.strip())
    if not m:
        raise ValueError(f"active hours must be HH:MM-HH:MM in 24-hour local time, e.g. 18:00-08:00 (got {text!r})")
    h0, m0, h1, m1 = (int(g) for g in m.groups())
    start, end = 60 * h0 + m0, 60 * h1 + m1
    if start == end:
        raise ValueError(f"active hours {text!r} are an empty window (use \"\" for always)")
    return start, end
