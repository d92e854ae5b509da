"""The trainer's side of its owner's controls: the control API server (peer/control/) fed with the trainer's
figures, and the limits applied between inner steps (threads, the duty cycle's rest).

What to do about a pause or a finish is decided in the training loop (peer/run/trainer.py); this module only
serves the requests and the figures, and rests.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from peer.config import PeerConfig
from peer.control.controls import Controls
from peer.control.feed import EventFeed
from peer.control.limits import Limits
from peer.control.metrics import MetricsEndpoint
from peer.control.server import ControlServer
from peer.net.flow.bandwidth import cap_warnings
from peer.net.flow.links import wire_bytes
from peer.outer.codec import Codec
from peer.util import host_peak_bytes

log = logging.getLogger(__name__)
REST_SLICE_S = 1.0  # a rest is cut in slices this long: a stop, pause or finish request ends it within one


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps and while waiting for a round. ``wake`` is set too
    (a paused or resting loop waits on it). Only the signal handler sets ``event``; the trainer gives ``wake`` at
    creation or to :meth:`install`."""

    def __init__(self, wake: Optional[threading.Event] = None) -> None:
        self.event = threading.Event()
        self.wake = wake

    def install(self, wake: Optional[threading.Event] = None) -> None:
        """Handles SIGINT and SIGTERM from now on; ``wake``: also set by them (None: the one given at creation)."""
        if wake is not None:
            self.wake = wake
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        log.info("received %s: finishing the current step and leaving the swarm", signal.Signals(signum).name)
        self.event.set()
        if self.wake is not None:
            self.wake.set()


class OwnerLink:
    """Created by the trainer with its config; :meth:`start` once the run dir is locked and the DHT process has
    forked, :meth:`stop` at exit.

    ``figures`` (:meth:`peer.run.figures.Figures.snapshot`) returns the live figures of the status reply; the rest
    is kept here: rounds by status (:meth:`count_round`), the fragments' last published round and digest
    (:meth:`note_fragment`), written by the training thread and read by the control API's threads."""

    def __init__(self, cfg: PeerConfig, stop_event, figures: Callable[[], dict[str, Any]] = dict):
        self.cfg = cfg
        self.stop_event = stop_event
        self.controls = Controls(Limits(duty_cycle=cfg.limits.duty_cycle, threads=cfg.inner.threads,
                                        active_hours=cfg.limits.active_hours, upload_mbps=cfg.limits.upload_mbps,
                                        download_mbps=cfg.limits.download_mbps))
        self.feed = EventFeed()
        self.figures = figures
        self.rounds_by_status: dict[str, int] = {}  # (replaced whole: the control API's threads read it)
        self.fragments: dict[int, dict[str, Any]] = {}  # index -> FragmentStatus fields (replaced whole)
        self.started = time.monotonic()
        self._default_threads = torch.get_num_threads()
        self._threads_in_force = cfg.inner.threads
        self._traffic: list[tuple[str, float, float, str]] = []  # what the caps are checked against: note_traffic
        self._caps_checked = (0.0, 0.0)  # the bandwidth caps last checked against the deadlines
        self.server: Optional[ControlServer] = None
        self.metrics: Optional[MetricsEndpoint] = None

    def start(self, run_dir: Path) -> None:
        """Serves the control API (``run.control``) and the metrics (``run.metrics_port``); a peer whose endpoint
        cannot be bound trains on without it (a warning says so)."""
        run = self.cfg.run
        if run.control:
            server = ControlServer(run_dir, self.controls, self.status, self.feed)
            try:
                server.start()
                self.server = server
            except OSError as e:
                log.warning("control API not available (%s): swarm-peer status|pause|finish will not reach this "
                            "peer", e)
        if run.metrics_port:
            metrics = MetricsEndpoint(self.status, self.controls)
            try:
                metrics.start(run.metrics_host, run.metrics_port)
                self.metrics = metrics
            except OSError as e:
                log.warning("metrics endpoint %s:%d not available (%s)", run.metrics_host, run.metrics_port, e)

    def stop(self) -> None:
        for endpoint in (self.server, self.metrics):
            if endpoint is not None:
                endpoint.stop()
        self.server = self.metrics = None
        self.feed.close()

    # ---- figures ------------------------------------------------------------------------------------
    def count_round(self, status: str) -> None:
        self.rounds_by_status = {**self.rounds_by_status, status: self.rounds_by_status.get(status, 0) + 1}

    def note_fragment(self, index: int, round_: int, digest: str, numel: int) -> None:
        self.fragments = {**self.fragments, index: dict(index=index, round=round_, digest=digest, numel=numel)}

    def status(self) -> dict[str, Any]:
        """The StatusReply's fields (called from the control API's threads: reads snapshots only)."""
        device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
        return dict(self.figures(), fragments=[f for _, f in sorted(self.fragments.items())],
                    rounds_by_status=dict(self.rounds_by_status), host_peak_bytes=host_peak_bytes(),
                    device_peak_bytes=device_peak, uptime_seconds=time.monotonic() - self.started)

    # ---- limits between steps -------------------------------------------------------------------------
    def note_traffic(self, largest_numel: int, codec: Codec) -> None:
        """What the largest fragment moves, for the bandwidth caps' check: in each direction its all-reduce moves
        up to two encoded copies (parts out and averages back, ``2 (M-1)/M`` of it; the parts, sent side by side,
        up to one copy, each due within part_timeout), a state transfer its ``G`` and ``v`` in fp32. Must be
        called once the fragments are known, before :meth:`apply_limits`."""
        sw = self.cfg.swarm
        encoded = wire_bytes(codec, largest_numel)
        if sw.deadlines == "measured":  # the deadlines follow the links, up to deadline_max (peer/net/flow/links.py)
            self._traffic = [("all-reduce", 2 * encoded, sw.deadline_max, "deadline_max"),
                             ("state transfer", 8 * largest_numel, sw.deadline_max, "deadline_max")]
            return
        self._traffic = [("all-reduce", 2 * encoded, sw.allreduce_timeout, "allreduce_timeout"),
                         ("parts", encoded, sw.part_timeout, "part_timeout"),
                         ("state transfer", 8 * largest_numel, sw.state_timeout, "state_timeout")]

    def apply_limits(self) -> None:
        """Applies changed limits (the training thread, between steps): the thread count here; the bandwidth caps
        are read by the pacers at every message (peer/net/flow/bandwidth.py), and checked here against the rounds'
        deadlines whenever they change."""
        limits = self.controls.limits.get()
        if limits.threads != self._threads_in_force:
            torch.set_num_threads(limits.threads or self._default_threads)
            log.info("inner step threads: %s", limits.threads or f"torch's default ({self._default_threads})")
            self._threads_in_force = limits.threads
        caps = limits.byte_rates()
        if caps != self._caps_checked:
            self._caps_checked = caps
            for line in cap_warnings(caps, self._traffic):
                log.warning(line)

    def rest(self, step_seconds: float, show: Callable[[str], None]) -> None:
        """Rests after an inner step of ``step_seconds`` as the duty cycle asks; ends early on a stop, pause or
        finish request or a changed limit (the next step rests by the new one)."""
        limits = self.controls.limits.get()
        end = time.monotonic() + limits.rest_after(step_seconds)
        while (left := end - time.monotonic()) > 0 and not self.stop_event.is_set():
            show(f"resting: duty cycle {limits.duty_cycle}%")
            if self.controls.wake.wait(min(left, REST_SLICE_S)):
                self.controls.wake.clear()
                if self.controls.finish_requested or self.controls.pause_reason() or \
                        self.controls.limits.get() != limits:
                    return
