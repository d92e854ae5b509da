"""What the owner of a peer asked for (pause, resume, finish, limits) and what the peer is doing: the object the
control API's threads write and the training loop reads (pure: no networking).

The training loop is the one authority on what happens: requests here are intents, read between inner steps
(:meth:`Controls.pause_reason`, :attr:`Controls.finish_requested`); the loop reports what it does with
:meth:`Controls.enter`. Every request sets :attr:`Controls.wake`, so a loop that rests or is paused reacts at once.
"""

from __future__ import annotations

import datetime
import enum
import threading
from typing import Optional

from peer.control.limits import Limits, LimitsBox


class PeerState(enum.StrEnum):
    """What the peer is doing (the control API's ``PeerState``)."""

    STARTING = "starting"  # joining, resuming, waiting for peers, catching up
    TRAINING = "training"
    PAUSING = "pausing"  # completing the rounds in flight and writing a checkpoint; PAUSED follows
    PAUSED = "paused"  # by the owner, or outside the active hours
    FINISHING = "finishing"  # completing the rounds in flight, then a checkpoint and exit 0


class Controls:
    """Owner's requests and the peer's state, shared between threads. Create one per peer process."""

    def __init__(self, limits: Limits):
        self.limits = LimitsBox(limits)
        self.wake = threading.Event()  # set by every request (and by stop signals, via the trainer)
        self._lock = threading.Lock()
        self._paused_by_owner = False
        self._finish = False
        self._state = PeerState.STARTING
        self._detail = "joining the swarm"

    # ---- requests (control API threads) ----------------------------------------------------------------
    def pause(self) -> str:
        """The owner asks to pause; returns what happens, in words."""
        with self._lock:
            already = self._paused_by_owner
            self._paused_by_owner = True
        self.wake.set()
        return "already paused" if already else "pausing after the current step (rounds in flight complete)"

    def resume(self) -> str:
        with self._lock:
            was = self._paused_by_owner
            self._paused_by_owner = False
        self.wake.set()
        if not was:
            return "not paused by the owner" + ("; outside the active hours" if not self.limits.get().active() else "")
        return "resuming: meeting the swarm's phase and state first"

    def finish(self) -> str:
        with self._lock:
            already = self._finish
            self._finish = True
        self.wake.set()
        return "already finishing" if already else \
            "finishing: completing the rounds in flight, then a checkpoint and exit"

    def set_limits(self, **changes) -> Limits:
        """Replaces the given limits (None = keep); ValueError on an invalid value (nothing changed)."""
        limits = self.limits.update(**changes)
        self.wake.set()
        return limits

    # ---- what the loop reads ---------------------------------------------------------------------------
    @property
    def finish_requested(self) -> bool:
        return self._finish

    def pause_reason(self, now: Optional[datetime.datetime] = None) -> Optional[str]:
        """Why the peer must not train right now (the owner paused it, or it is outside the active hours), or None."""
        if self._paused_by_owner:
            return "paused by the owner"
        limits = self.limits.get()
        if not limits.active(now):
            return f"outside the active hours {limits.active_hours}"
        return None

    # ---- what the loop reports ---------------------------------------------------------------------------
    def enter(self, state: PeerState, detail: str = "") -> None:
        with self._lock:
            self._state, self._detail = state, detail

    def state(self) -> tuple[PeerState, str]:
        with self._lock:
            return self._state, self._detail
