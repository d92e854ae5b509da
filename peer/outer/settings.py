"""The outer engine's settings, and the one of them resolved while it runs: ``tau = auto``.

:class:`OuterSettings` is the engine's view of ``[outer]``; :class:`AutoTau` turns ``tau = auto`` into an overlap
per round from this peer's measured step and round times (the trainer asks it at each launch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from peer.config import OuterConfig, default_of


@dataclass(kw_only=True)
class OuterSettings:
    """The engine's view of the ``[outer]`` settings. :class:`~peer.config.OuterConfig` (``peer/config/sections.py``)
    is the one source of truth: it documents every field, and the defaults here are its defaults. ``H`` is its
    ``sync_every``; ``tau`` is an integer (``auto`` is resolved round by round through the engine's
    ``tau_fn``). Build it from a config with :meth:`from_config`; tests and the simulator set fields directly.
    """

    H: int
    lr: float = default_of(OuterConfig, "lr")
    momentum: float = default_of(OuterConfig, "momentum")
    alpha: float = default_of(OuterConfig, "alpha")
    tau: int = 0
    eager: bool = default_of(OuterConfig, "eager")
    merge: str = default_of(OuterConfig, "merge")
    wait_timeout: float = default_of(OuterConfig, "wait_timeout")

    def __post_init__(self) -> None:
        if self.H < 1 or not 0 <= self.tau <= self.H:
            raise ValueError(f"need H >= 1 and 0 <= tau <= H (got H={self.H}, tau={self.tau})")
        if self.merge not in ("alpha", "replay") or not 0 <= self.alpha <= 1:
            raise ValueError(f"merge must be alpha or replay and alpha in [0, 1] (got {self.merge}, {self.alpha})")

    @classmethod
    def from_config(cls, outer: OuterConfig) -> "OuterSettings":
        """The settings of ``outer`` (``tau = auto`` starts at 0: the engine's ``tau_fn`` decides per round)."""
        return cls(H=outer.sync_every, lr=outer.lr, momentum=outer.momentum, alpha=outer.alpha,
                   tau=outer.tau if isinstance(outer.tau, int) else 0, eager=outer.eager, merge=outer.merge,
                   wait_timeout=outer.wait_timeout)


class AutoTau:
    """``tau = auto``: enough inner steps to hide this peer's measured round time, at most ``tau_max``.

    ``tau = ceil(round_seconds / step_seconds) + 1`` from exponential moving averages; ``tau_max``
    until both have been measured (overlap as much as allowed while nothing is known).
    """

    def __init__(self, tau_max: int, smoothing: float = 0.3):
        self.tau_max, self.smoothing = tau_max, smoothing
        self.step_seconds: Optional[float] = None
        self.round_seconds: Optional[float] = None

    def _ema(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_step(self, seconds: float) -> None:
        self.step_seconds = self._ema(self.step_seconds, seconds)

    def observe_round(self, seconds: float) -> None:
        self.round_seconds = self._ema(self.round_seconds, seconds)

    def __call__(self) -> int:
        if not self.step_seconds or self.round_seconds is None:
            return self.tau_max
        return max(1, min(self.tau_max, math.ceil(self.round_seconds / self.step_seconds) + 1))
