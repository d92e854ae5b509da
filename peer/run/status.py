"""The console status line: what the peer is doing, in words, every ``status_interval`` seconds.

A user should never have to read round lines (or wonder at silence) to know what the peer waits for: the line
is also shown while the peer is blocked (waiting for peers at start, for a round's aggregate, for a peer that
is behind by wall time), and :func:`describe` turns the peer's state into the words it shows.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional, Sequence

from peer.run.events import fmt_bytes
from peer.net.view.activity import RoundActivity, RoundStage


def describe(*, now: float, live: int, need: int, activity: Sequence[RoundActivity], blocked: bool,
             moved_ahead: Optional[int]) -> str:
    """What the peer is doing (pure). ``live``: peers visible, us included; ``need``: the smallest group;
    ``activity``: its rounds in flight; ``blocked``: the training loop waits for a round's aggregate;
    ``moved_ahead``: steps the step counter moved up lately to meet the swarm (steps schedule), or None."""
    for act in activity:
        if act.stage is RoundStage.PATIENT:
            return (f"waiting for {len(act.waiting_for)} peer(s) behind by wall time to reach fragment "
                    f"{act.fragment} round {act.round} (up to {max(0.0, act.until - now):.0f} s)")
    if moved_ahead is not None:
        return f"out of phase with the swarm: moved ahead {moved_ahead} steps to meet it"
    if live < need:
        return f"alone: waiting for peers ({live} visible, a group needs {need})"
    if blocked and activity:
        act = activity[0]
        if act.stage is RoundStage.MATCHMAKING:
            return (f"waiting for peers ({live} visible) in fragment {act.fragment} round {act.round} "
                    f"(up to {max(0.0, act.until - now):.0f} s)")
        return f"averaging fragment {act.fragment} round {act.round}"
    return "training"


class StatusLine:
    """A compact live status line: rewritten in place on a terminal, a log line otherwise. ``doing`` is
    :func:`describe`'s words, or the caller's ("waiting for peers (2/3 visible, up to 60 s)")."""

    def __init__(self, interval: float, peer_label: str):
        self.interval, self.peer_label = interval, peer_label
        self._last = 0.0
        self._tty = sys.stderr.isatty() and os.environ.get("TERM") != "dumb"

    def due(self) -> bool:
        return self.interval > 0 and time.monotonic() - self._last >= self.interval

    def show(self, *, step: int, loss: Optional[float], floor: Optional[float], tok_s: float, peers: int,
             rounds: str, next_sync: str, up: int, down: int, doing: str) -> None:
        """Prints the line now (callers check :meth:`due` first, or force it)."""
        self._last = time.monotonic()
        floor_txt = f" (floor {floor:.3f})" if floor is not None else ""
        loss_txt = f" loss {loss:.4f}{floor_txt}" if loss is not None else ""
        line = (f"step {step}{loss_txt} {tok_s:,.0f} tok/s | {doing} | peers {peers} rounds ok {rounds} "
                f"next sync {next_sync} up {fmt_bytes(up)} down {fmt_bytes(down)}")
        if self._tty:
            sys.stderr.write(f"\r\033[K[{self.peer_label}] {line}")
            sys.stderr.flush()
        else:  # the log format names the peer already
            logging.getLogger("peer.status").info(line)
