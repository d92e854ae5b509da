"""What the owner sees of a training peer: the status line on the console (also while blocked, so the user never
sees silence), the ``step`` event every ``log_every`` steps, and the figures of the control API's status reply.

:class:`Figures` keeps what the training loop measures (the step, the last loss read from the device, the data's
entropy floor, the model's device, when the last inner step ended, the throughput) and reads the rest from the
parts the trainer made (the swarm, the engine, the ledger, the shared model's evaluation, the phase keeper,
``tau = auto``), each handed to it once made.
"""

from __future__ import annotations

import time
from typing import Optional

from peer.config import PeerConfig
from peer.local.inner import StepStats
from peer.net.swarm import Swarm
from peer.outer.engine import StreamingEngine
from peer.outer.settings import AutoTau
from peer.run.evaluation import SharedEval
from peer.run.events import EventLog
from peer.run.ledger import RoundLedger
from peer.run.phase import PhaseKeeper
from peer.run.status import StatusLine, describe
from peer.run.throughput import Throughput


class Figures:
    """Created by the trainer with its config. Its fields are written by the training thread only (the loop's
    measured figures, and each part once it is made); the control API's threads call :meth:`snapshot`, which
    reads plain values of them."""

    def __init__(self, cfg: PeerConfig, ledger: RoundLedger, events: EventLog):
        self.cfg, self.ledger, self.events = cfg, ledger, events
        self.peer_id = self.run_hash = ""
        self.step = 0  # for the status line while blocked
        self.loss: Optional[float] = None  # the last loss read from the device (every log_every steps)
        self.floor: Optional[float] = None  # the data's entropy floor, where the source knows it
        self.device = cfg.inner.device
        self.last_step_at = time.monotonic()  # the last inner step (or the start of training): idle_seconds
        self.throughput = Throughput()  # tokens/s, compute seconds, the step time: restarted when the loop starts
        self.status: Optional[StatusLine] = None
        # the trainer's parts, each set once it is made
        self.swarm: Optional[Swarm] = None
        self.engine: Optional[StreamingEngine] = None
        self.evaluation: Optional[SharedEval] = None
        self.phase: Optional[PhaseKeeper] = None
        self.auto_tau: Optional[AutoTau] = None

    def tau(self) -> int | str:
        """The overlap in force: ``tau = auto``'s choice now, else the configured tau."""
        return self.auto_tau() if self.auto_tau else self.cfg.outer.tau

    def show(self, doing: Optional[str] = None) -> None:
        """Prints the status line if it is due (also called while blocked, so the user never sees silence)."""
        if self.status is None or not self.status.due() or self.swarm is None:
            return
        ledger, swarm, engine = self.ledger, self.swarm, self.engine
        self.status.show(step=self.step, loss=self.loss, floor=self.floor, tok_s=self.throughput.tokens_per_second,
                         peers=swarm.live_count(), rounds=f"{ledger.ok}/{ledger.total}",
                         next_sync=engine.schedule.describe_next(self.step) if engine else "-",
                         up=ledger.bytes_up, down=ledger.bytes_down, doing=doing or describe(
                             now=time.monotonic(), live=swarm.live_count(), need=self.cfg.swarm.min_group_size,
                             activity=swarm.activity(), blocked=bool(engine and engine.waits.waiting),
                             moved_ahead=self.phase.moved_ahead() if self.phase else None))

    def log_step(self, step: int, stats: StepStats, engine: StreamingEngine) -> None:
        """The ``step`` event (every ``log_every`` steps): the losses, the throughput of the steps since the last
        one, and compute against blocked seconds (compute utilization = compute / (compute + blocked))."""
        t = self.throughput
        t.lap()
        self.events.emit("step", step=step, loss=stats.loss, ce=stats.ce, lr=stats.lr, tokens=t.tokens,
                         tokens_per_second=t.tokens_per_second, elapsed=t.elapsed, floor=self.floor,
                         compute_seconds=t.compute_seconds, blocked_seconds=engine.waits.blocked_seconds,
                         tau=self.tau(), loop_seconds={k: round(v, 4) for k, v in t.parts.seconds.items()})

    def snapshot(self) -> dict:
        """The live figures for the control API's status (read from another thread: plain values)."""
        engine, swarm = self.engine, self.swarm
        tau = self.tau()  # ("auto" until the engine is built: reported as 0)
        return dict(peer_id=self.peer_id, run_hash=self.run_hash, step=self.step, loss=self.loss,
                    tokens_per_second=self.throughput.tokens_per_second, live_peers=swarm.live_count() if swarm else 1,
                    paused_peers=len(swarm.paused_peers()) if swarm else 0,
                    next_sync=engine.schedule.describe_next(self.step) if engine else "-",
                    bytes_up=self.ledger.bytes_up, bytes_down=self.ledger.bytes_down,
                    tau=tau if isinstance(tau, int) else 0, device=self.device,
                    idle_seconds=time.monotonic() - self.last_step_at,
                    excluded_peers=sorted(swarm.exclusions.excluded()) if swarm else [], **self._eval_figures())

    def _eval_figures(self) -> dict:
        last = self.evaluation.last if self.evaluation is not None else None
        if last is None:
            return dict(eval_loss=None, eval_perplexity=None, eval_round=0)
        return dict(eval_loss=last.loss, eval_perplexity=last.perplexity, eval_round=last.rounds[0])
