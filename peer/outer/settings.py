"""The outer engine's settings, and the one of them resolved while it runs: ``tau = auto``.

:class:`OuterSettings` is the engine's view of ``[outer]``; :class:`AutoTau` turns ``tau = auto`` into an overlap
per round from this peer's measured step and round times (the trainer asks it at each launch).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Optional

from peer.config import OuterConfig, default_of
from peer.config.fields import DENSE_OUTER_STEP
from peer.util import Ema


@dataclass(kw_only=True)
class OuterSettings:
    """The engine's view of the ``[outer]`` settings. :class:`~peer.config.OuterConfig` (``peer/config/sections.py``)
    is the one source of truth: it documents every field, and the defaults here are its defaults (``lr`` and
    ``momentum``: what its ``auto`` is for a dense codec; a config resolves it for its own codec). ``H`` is its
    ``sync_every``; ``tau`` is an integer (``auto`` is resolved round by round through the engine's
    ``tau_fn``). Build it from a config with :meth:`from_config`; tests and the simulator set fields directly.
    """

    H: int
    lr: float = DENSE_OUTER_STEP[0]  # (``auto``'s values for a dense codec: a config resolves it for its codec)
    momentum: float = DENSE_OUTER_STEP[1]
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
        lr, momentum = outer.nesterov
        return cls(H=outer.sync_every, lr=lr, momentum=momentum, alpha=outer.alpha,
                   tau=outer.tau if isinstance(outer.tau, int) else 0, eager=outer.eager, merge=outer.merge,
                   wait_timeout=outer.wait_timeout)


def clamp_tau(tau: int, H: int, tau_max: Optional[int] = None) -> int:
    """A round's overlap as ``tau = auto`` may choose it: 0 to ``H - 1`` inner steps (``tau = H``, the one-outer-step
    mode, is a fixed setting only); with ``tau_max`` (>= 1, as ``[outer]`` checks), also 1 to ``tau_max``."""
    low, high = (0, H - 1) if tau_max is None else (1, min(H - 1, tau_max))
    return max(0, min(high, max(low, tau)))


class AutoTau:
    """``tau = auto``: enough inner steps to hide this peer's round time, at least 1 and at most ``tau_max``
    (within :func:`clamp_tau`).

    ``tau = ceil(round_seconds / step_seconds) + 1``: the step time is the trainer's moving average (``step_time``,
    which it alone updates); the round time is the slowest of our last ``window`` averaged rounds
    (:meth:`observe_round`), from the launch until the aggregate was applied to copies of the state off the training
    thread (``RoundOutcome.ready_seconds``: on a fast GPU the worker's part can outlast the network's): a round that
    outlasts the overlap stalls training, and covering the average round leaves about half of them stalling.
    ``tau_max`` until both have been measured (overlap as much as allowed while nothing is known).
    """

    def __init__(self, tau_max: int, H: int, step_time: Ema, window: int = 8):
        self.tau_max, self.H, self.step_time = tau_max, H, step_time
        self.rounds: collections.deque[float] = collections.deque(maxlen=window)

    def observe_round(self, seconds: float) -> None:
        self.rounds.append(seconds)

    def __call__(self) -> int:
        step, round_ = self.step_time.value, max(self.rounds, default=None)
        tau = self.tau_max if not step or round_ is None else math.ceil(round_ / step) + 1
        return clamp_tau(tau, self.H, self.tau_max)
