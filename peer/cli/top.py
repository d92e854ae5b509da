"""``swarm-peer top --run-dir R``: a live terminal dashboard of a running peer (textual), fed by its control API:
what it is doing, a loss curve and a tokens/s curve, peers, rounds by status, bandwidth, the fragments' rounds
and digests, the limits. Keys: ``p`` pause, ``r`` resume, ``f`` finish, ``q`` quit (the peer runs on).
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from typing import Optional

from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, Sparkline, Static

from peer.control.client import ControlClient, ControlError, describe_held_out
from peer.control.limits import describe_limits
from peer.proto import control_pb2 as pb
from peer.run.events import fmt_bytes

HISTORY = 240  # points of each curve (4 minutes at the default refresh)


class TopApp(App):
    """The dashboard. ``client`` talks to the peer; every ``refresh`` s one Status call (2 s deadline)."""

    TITLE = "swarmloco"
    CSS = """
    #state { height: 3; padding: 0 1; }
    .curve { height: 6; border: round $accent; padding: 0 1; }
    #figures { height: auto; padding: 0 1; }
    #fragments { height: auto; max-height: 12; }
    """
    BINDINGS = [("p", "pause", "Pause"), ("r", "resume", "Resume"), ("f", "finish", "Finish"), ("q", "quit", "Quit")]

    def __init__(self, client: ControlClient, refresh: float = 1.0):
        super().__init__()
        self.client, self.refresh_s = client, max(0.2, refresh)
        self.losses: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.speeds: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.last: Optional[pb.StatusReply] = None
        self.note = ""  # the answer of the last key press

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("connecting...", id="state")
        with Horizontal():
            with Vertical(classes="curve"):
                yield Static("loss", id="loss-label")
                yield Sparkline([], id="loss")
            with Vertical(classes="curve"):
                yield Static("tokens/s", id="speed-label")
                yield Sparkline([], id="speed")
        yield Static("", id="figures")
        yield DataTable(id="fragments")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#fragments", DataTable)
        table.add_columns("fragment", "round", "digest", "parameters")
        self.set_interval(self.refresh_s, self.poll)
        self.poll()

    def poll(self) -> None:
        """One Status call, shown. A no-op once the app shuts down: textual removes the screens before it stops
        the app's timers, so a tick may come after the widgets are gone."""
        if not self.is_running:
            return
        try:
            s = self.client.status()
        except ControlError as e:
            self.query_one("#state", Static).update(f"[b red]{e}[/]")
            return
        if self.last is None or s.step != self.last.step:
            if not math.isnan(s.loss):
                self.losses.append(s.loss)
            self.speeds.append(s.tokens_per_second)
        self.last = s
        self.show(s)

    def show(self, s: pb.StatusReply) -> None:
        state = pb.PeerState.Name(s.state).lower()
        detail = f": {s.detail}" if s.detail else ""
        note = f"   [i]{self.note}[/]" if self.note else ""
        self.query_one("#state", Static).update(
            f"[b]{state}[/]{detail}   peer {s.peer_id[-8:]}  step {s.step}  on {s.device}  tau {s.tau}{note}")
        loss = "-" if math.isnan(s.loss) else f"{s.loss:.4f}"
        self.query_one("#loss-label", Static).update(f"loss {loss}")
        self.query_one("#loss", Sparkline).data = list(self.losses)
        self.query_one("#speed-label", Static).update(f"tokens/s {s.tokens_per_second:,.0f}")
        self.query_one("#speed", Sparkline).data = list(self.speeds)
        rounds = ", ".join(f"{k} {v}" for k, v in sorted(s.rounds_by_status.items())) or "none yet"
        self.query_one("#figures", Static).update(
            f"peers {s.live_peers} live, {s.paused_peers} paused   next sync {s.next_sync}\n"
            f"rounds: {rounds}   held-out loss {describe_held_out(s)}\n"
            f"up {fmt_bytes(s.bytes_up)}  down {fmt_bytes(s.bytes_down)}   host peak {fmt_bytes(s.host_peak_bytes)}"
            f"   excluded {len(s.excluded_peers)}\n"
            f"limits: {describe_limits(s.limits)}")
        table = self.query_one("#fragments", DataTable)
        table.clear()
        for f in s.fragments:
            table.add_row(str(f.index), str(f.round), f.digest[:16], f"{f.numel:,}")

    def _control(self, what: str) -> None:
        try:
            self.note = getattr(self.client, what)().message
        except ControlError as e:
            self.note = str(e)
        self.poll()

    def action_pause(self) -> None:
        self._control("pause")

    def action_resume(self) -> None:
        self._control("resume")

    def action_finish(self) -> None:
        self._control("finish")


def run(ns: argparse.Namespace) -> int:
    try:
        client = ControlClient(ns.run_dir, timeout=2.0)
    except ControlError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2
    with client:
        TopApp(client, ns.refresh).run()
    return 0
