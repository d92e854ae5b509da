"""The training loop: the one place that composes model, data, inner loop, outer state and swarm.

One peer, per inner step: take a batch from its own shard, step AdamW, then let the
:class:`~peer.streaming.StreamingEngine` launch the fragments that are due (``(t - t_p) mod H == 0``)
through the swarm and apply the aggregates that are due (``launch + tau``). The swarm's heartbeat
publishes our progress. SIGINT/SIGTERM stop the loop between steps; a round in flight is abandoned
(nothing of it is applied) and the peer leaves the swarm cleanly.
"""

from __future__ import annotations

import hashlib
import logging
import random
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from peer import checkpoint
from peer.codec import get_codec, make_codec
from peer.config import PeerConfig
from peer.data import make_source
from peer.dht_node import ensure_identity
from peer.events import EventLog, StatusLine, setup_logging
from peer.fragments import Fragment, partition
from peer.inner import InnerLoop
from peer.model import build_model, count_parameters
from peer.outer import FragmentState, RoundOutcome
from peer.schedule import ClockSchedule, StepsSchedule
from peer.state_transfer import DownloadError, Snapshot, launch_gate, plan_catch_up
from peer.streaming import AutoTau, OuterSettings, StreamingEngine
from peer.swarm import Swarm

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps and while waiting for a round."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        log.info("received %s: finishing the current step and leaving the swarm", signal.Signals(signum).name)
        self.event.set()


class Trainer:
    """Runs one peer until ``max_steps`` or a stop signal. Create, then call :meth:`run` once."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.run_dir)
        self.stop = StopFlag()
        self.events = EventLog(cfg.run.log_json)
        self.swarm: Optional[Swarm] = None
        self.bytes_up = self.bytes_down = 0
        self.peers_seen = 1
        self.rounds_done = 0
        self.engine: Optional[StreamingEngine] = None  # set in _train
        self.found_late = False  # a round was late (launch_gate): catch up right after this step
        self.auto_tau: Optional[AutoTau] = None
        self._found_checkpoint = None

    def run(self) -> int:
        """Trains; returns the process exit code (0 on max_steps or a stop signal)."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        peer_id = ensure_identity(cfg.identity_path)
        label = f"peer {peer_id[-8:]}"
        setup_logging(cfg.run.log_level, self.run_dir / "peer.log", label)
        self.stop.install()
        run_hash = cfg.run_hash()
        log.info("resolved config (run hash %s): %s", run_hash, cfg.to_dict())
        # Before joining the swarm: a checkpoint of another run in this run dir is a usage error.
        self._found_checkpoint = checkpoint.load_latest(self.run_dir / "checkpoints")
        if self._found_checkpoint is not None and self._found_checkpoint[1].get("run_hash") != run_hash:
            raise ValueError(f"--run-dir {self.run_dir} holds a checkpoint of another run (run hash "
                             f"{self._found_checkpoint[1].get('run_hash')}, this config's is {run_hash}): "
                             f"use another --run-dir")
        # The DHT forks a process: start it before anything can initialize CUDA.
        codec = make_codec(cfg.outer.codec, stochastic_rounding=True) if cfg.outer.stochastic_rounding else cfg.outer.codec
        self.swarm = Swarm(cfg.swarm, run_key=run_hash, codec=codec, identity_path=str(cfg.identity_path))
        try:
            self.swarm.start()
            log.info("joined the swarm as %s; listening on %s", peer_id, " ".join(self.swarm.visible_maddrs()))
            self.events.emit("start", peer_id=peer_id, run_hash=run_hash, maddrs=self.swarm.visible_maddrs(),
                             config=cfg.to_dict())
            return self._train(label)
        finally:
            self.swarm.shutdown()
            self.events.close()
            log.info("left the swarm")

    def _build(self):
        cfg = self.cfg
        if cfg.inner.threads:
            torch.set_num_threads(cfg.inner.threads)
        device = pick_device(cfg.inner.device)
        torch.manual_seed(cfg.model.init_seed)  # identical theta_0 on every peer of the run
        model, blocks = build_model(cfg.model.preset, cfg.data.vocab_size, cfg.model.seq_len,
                                     cfg.model.factory or None)
        model.to(device)
        shard = cfg.data.shard if cfg.data.shard >= 0 else \
            int.from_bytes(hashlib.sha256(self.swarm.peer_id.encode()).digest()[:4], "little")
        source = make_source(cfg.data.source, paths=cfg.data.paths, vocab_size=cfg.data.vocab_size,
                             seed=cfg.data.seed, shard_index=shard)
        inner = InnerLoop(model, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                          betas=(cfg.inner.beta1, cfg.inner.beta2), warmup_steps=cfg.inner.warmup_steps,
                          total_steps=cfg.inner.total_steps, min_lr_ratio=cfg.inner.min_lr_ratio,
                          grad_clip=cfg.inner.grad_clip, z_loss=cfg.inner.z_loss, device=device)
        log.info("model %s: %s parameters on %s; data %s shard %d", cfg.model.factory or cfg.model.preset,
                 f"{count_parameters(model):,}", device, cfg.data.source, shard)
        return model, blocks, source, inner

    def _wait_for_peers(self) -> None:
        """Blocks until ``min_peers`` peers of this run are visible, a stop signal, or start_timeout."""
        want, deadline = self.cfg.swarm.min_peers, time.monotonic() + self.cfg.swarm.start_timeout
        while want > 1 and not self.stop.event.is_set():
            self.peers_seen = self.swarm.live_count()
            if self.peers_seen >= want or time.monotonic() > deadline:
                break
            self.stop.event.wait(min(1.0, self.cfg.swarm.progress_period))
        log.info("%d peer(s) of this run visible (wanted %d); starting to train", self.peers_seen, want)

    def _train(self, label: str) -> int:
        cfg = self.cfg
        model, blocks, source, inner = self._build()
        fragments = partition(model, blocks, cfg.outer.fragment_blocks, cfg.outer.fragment_pattern)
        log.info("%d fragment(s) of %s elements (%s, %d blocks each); codec %s, tau %d, eager %s, merge %s",
                 len(fragments), [f.numel for f in fragments], cfg.outer.fragment_pattern,
                 cfg.outer.fragment_blocks, cfg.outer.codec, cfg.outer.tau, cfg.outer.eager, cfg.outer.merge)
        self.auto_tau = AutoTau(cfg.outer.tau_max) if cfg.outer.tau == "auto" else None
        settings = OuterSettings(H=cfg.outer.sync_every, lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                                 alpha=cfg.outer.alpha, tau=0 if self.auto_tau else cfg.outer.tau,
                                 eager=cfg.outer.eager, merge=cfg.outer.merge, wait_timeout=cfg.outer.wait_timeout)
        transport = SwarmTransport(self)
        engine = StreamingEngine(fragments, settings, transport, group_size_hint=lambda: self.peers_seen,
                                 stop=self.stop.event, on_outcome=lambda f, st, o, step: self._report(label, f, st, o,
                                                                                                    step),
                                 error_feedback_codec=get_codec(cfg.outer.codec) if cfg.outer.error_feedback else None,
                                 tau_fn=self.auto_tau, schedule=self._schedule(len(fragments)))
        self.engine = engine
        floor = getattr(source, "entropy_floor", None)
        status = StatusLine(cfg.run.status_interval, label)
        parts = dict(model=model, inner=inner, source=source, engine=engine)
        step = self._resume(**parts)
        for frag, st in zip(fragments, engine.states):
            self._publish_snapshot(frag, st, step)
        self._wait_for_peers()
        step = self._catch_up(engine, step, joining=True)
        last_drift_check = time.monotonic()
        t_start = time.monotonic()
        tokens_total, window_tokens, window_t0 = 0, 0, time.monotonic()
        tok_s, compute_seconds = 0.0, 0.0
        last_ckpt_time, last_ckpt_rounds = time.monotonic(), self.rounds_done
        while not self.stop.event.is_set() and (cfg.run.max_steps == 0 or step < cfg.run.max_steps):
            t_step = time.monotonic()
            batch = source.next_batch(cfg.data.batch_size, cfg.model.seq_len)
            stats = inner.step(batch)
            step_seconds = time.monotonic() - t_step
            compute_seconds += step_seconds
            if self.auto_tau is not None:
                self.auto_tau.observe_step(step_seconds)
            step += 1
            tokens_total += stats.tokens
            window_tokens += stats.tokens
            engine.add_tokens(stats.tokens)
            if step % cfg.run.log_every == 0:
                now = time.monotonic()
                tok_s, window_tokens, window_t0 = window_tokens / max(now - window_t0, 1e-9), 0, now
                # compute utilization = compute_seconds / (compute_seconds + blocked_seconds)
                self.events.emit("step", step=step, loss=stats.loss, ce=stats.ce, lr=stats.lr, tokens=tokens_total,
                                 tokens_per_second=tok_s, elapsed=now - t_start, floor=floor,
                                 compute_seconds=compute_seconds, blocked_seconds=engine.blocked_seconds,
                                 tau=self.auto_tau() if self.auto_tau else cfg.outer.tau)
            self.swarm.update_progress(step, engine.states[0].round, tok_s)
            engine.launch_due(step)
            engine.apply_due(step)
            if self.found_late or (cfg.swarm.drift_check_period and
                                   time.monotonic() - last_drift_check >= cfg.swarm.drift_check_period):
                step = self._catch_up(engine, step, joining=False, late=self.found_late)
                self.found_late, last_drift_check = False, time.monotonic()
            every = cfg.run.checkpoint_rounds
            if (cfg.run.checkpoint_minutes and time.monotonic() - last_ckpt_time >= 60 * cfg.run.checkpoint_minutes) or \
                    (every and engine.states[0].applied_rounds and self.rounds_done - last_ckpt_rounds >= every):
                self._checkpoint(step, **parts)
                last_ckpt_time, last_ckpt_rounds = time.monotonic(), self.rounds_done
            status.maybe_show(step=step, loss=stats.ce, floor=floor, tok_s=tok_s, peers=self.peers_seen,
                              next_sync=engine.schedule.describe_next(step), up=self.bytes_up, down=self.bytes_down)
        engine.abandon()
        self._checkpoint(step, **parts)
        reason = "stop signal" if self.stop.event.is_set() else f"max_steps={cfg.run.max_steps}"
        log.info("stopping after step %d (%s); %d rounds applied", step, reason, self.rounds_done)
        self.events.emit("stop", step=step, reason=reason, rounds=self.rounds_done, tokens=tokens_total)
        return 0

    def _publish_snapshot(self, frag: Fragment, st: FragmentState, step: int) -> None:
        self.swarm.publish_snapshot(Snapshot(frag.index, st.last_applied, step, st.G.clone(), st.v.clone(),
                                             st.digest()))

    def _catch_up(self, engine: StreamingEngine, step: int, *, joining: bool, late: bool = False) -> int:
        """Downloads the fragments where the swarm's majority state is ahead of or differs from ours
        (see plan_catch_up; ``late``: a round was just found late, see launch_gate: then every fragment the
        swarm is past, counting our rounds in flight, so that we rejoin with all of them at once); returns
        the step to continue from (steps schedule: the donors').
        Must be called after the step's launches and applies, so the adopted round is never re-launched."""
        records = self.swarm.live_peers()
        plans = plan_catch_up(records, self.swarm.peer_id, [st.last_applied for st in engine.states],
                              [st.digest() for st in engine.states], joining=joining,
                              expected=[engine.expected_round(p) for p in range(len(engine.states))] if late else None)
        donor_steps = []
        for plan in plans:
            frag, t0 = engine.fragments[plan.fragment], time.monotonic()
            random.shuffle(plan.donors)  # joiners spread over the donors
            try:
                snap = self.swarm.download_state(plan.fragment, plan.donors, round_=plan.round, numel=frag.numel,
                                                 digest=plan.digest)
            except DownloadError as e:
                log.warning("fragment %d: could not catch up (%s): %s", plan.fragment, plan.reason, e)
                continue
            engine.adopt(plan.fragment, snap.G, snap.v, snap.round)
            donor_steps.append(snap.step)
            self._publish_snapshot(frag, engine.states[plan.fragment], snap.step)
            log.info("fragment %d: caught up to round %d (digest %s) in %.1fs; %s", plan.fragment, snap.round,
                     snap.digest[:12], time.monotonic() - t0, plan.reason)
            self.events.emit("catch_up", fragment=plan.fragment, round=snap.round, digest=snap.digest,
                             step=snap.step, seconds=time.monotonic() - t0, reason=plan.reason)
        if donor_steps and isinstance(engine.schedule, StepsSchedule):
            # Lockstep: the next round we launch must be the swarm's next round, never one we just downloaded.
            # Behind the donors' step: move up to it. Back only if we ran ahead of everyone alone (our round
            # counter kept running during an outage); moving back otherwise would re-launch the other
            # fragments' rounds that we have already applied.
            swarm_step = max((rec.step for rec in records.values() if rec.peer_id != self.swarm.peer_id),
                             default=step)
            if step < max(donor_steps) or step > swarm_step + self.cfg.outer.sync_every:
                step = max(donor_steps)
        return step

    def _checkpoint(self, step: int, *, model, inner, source, engine) -> None:
        """Saves everything needed to resume (atomic; see peer/checkpoint.py)."""
        payload = {"format": 1, "run_hash": self.cfg.run_hash(), "step": step, "model": model.state_dict(),
                   "inner": inner.state_dict(), "data": source.state_dict(), "engine": engine.state_dict(),
                   "torch_rng": torch.get_rng_state()}
        path = checkpoint.save(self.run_dir / "checkpoints", step, payload, keep=self.cfg.run.checkpoint_keep)
        log.info("checkpoint at step %d: %s", step, path)

    def _resume(self, *, model, inner, source, engine) -> int:
        """Restores the newest good checkpoint of this run dir; returns the step to continue from."""
        found, self._found_checkpoint = self._found_checkpoint, None  # read (and checked) in run()
        if found is None:
            return 0
        path, state = found
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        source.load_state_dict(state["data"])
        engine.load_state_dict(state["engine"])
        torch.set_rng_state(state["torch_rng"])
        log.info("resumed from %s at step %d (rounds %s)", path.name, state["step"],
                 [st.round for st in engine.states])
        self.events.emit("resume", step=state["step"], checkpoint=str(path))
        return int(state["step"])

    def _schedule(self, num_fragments: int):
        cfg = self.cfg.outer
        if cfg.schedule == "clock":
            return ClockSchedule(cfg.round_seconds, num_fragments, origin=cfg.clock_origin)
        return StepsSchedule(cfg.sync_every, num_fragments)

    def _report(self, label: str, frag: Fragment, st: FragmentState, outcome: RoundOutcome, step: int) -> None:
        """Logs one applied (or missed) round: a readable line and a JSON ``round`` event."""
        applied = sum(s.average is not None for s in outcome.spans)
        self.rounds_done += applied > 0
        if outcome.status == "behind":  # given up in matchmaking: take the swarm's state right after this step
            self.found_late = True
        self._publish_snapshot(frag, st, step)
        if self.auto_tau is not None and outcome.status in ("ok", "partial"):
            self.auto_tau.observe_round(outcome.seconds)
        self.bytes_up += outcome.bytes_sent
        self.bytes_down += outcome.bytes_received
        digest = st.digest()
        missing = len(outcome.spans) - applied
        msg = (f"{label} fragment {frag.index} round {outcome.round}: {outcome.status}, group {outcome.group_size}, "
               f"{applied}/{len(outcome.spans)} spans applied, up {outcome.bytes_sent} B down "
               f"{outcome.bytes_received} B in {outcome.seconds:.2f}s, digest {digest[:12]}")
        quiet = outcome.status in ("ok", "alone", "behind")
        (log.info if quiet else log.warning)(msg + (f" ({outcome.error})" if outcome.error else ""))
        self.events.emit("round", fragment=frag.index, round=outcome.round, step=step, status=outcome.status,
                         launch_step=outcome.launch_step, numel=frag.numel,
                         group_size=outcome.group_size, bytes_sent=outcome.bytes_sent,
                         bytes_received=outcome.bytes_received, seconds=outcome.seconds, digest=digest,
                         spans_applied=applied, spans_missing=missing, total_weight=outcome.total_weight,
                         contributors=outcome.contributors, error=outcome.error)


class _Done:
    """A handle for a round that finished before it started (e.g. no one to average with)."""

    def __init__(self, outcome: RoundOutcome):
        self.outcome = outcome

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        return self.outcome

    def cancel(self) -> bool:
        return False


class SwarmTransport:
    """The engine's Transport over the swarm: reads the live peers, skips rounds alone or behind the swarm."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def launch(self, *, fragment: int, round_: int, delta: torch.Tensor, weight: float, step: int):
        tr, cfg = self.trainer, self.trainer.cfg
        records, me = tr.swarm.live_peers(), tr.swarm.peer_id  # as of the last heartbeat: never blocks
        tr.peers_seen = 1 + sum(pid != me for pid in records)
        if tr.peers_seen < cfg.swarm.min_group_size:
            # Alone in the run: no group can form; the progress is kept for the next round.
            return _Done(RoundOutcome(fragment, round_, "alone", group_size=1,
                                      error=f"{tr.peers_seen} live peer(s) < min_group_size "
                                            f"{cfg.swarm.min_group_size}"))
        why = launch_gate(records, me, fragment, round_, tr.engine.expected_round(fragment))
        if why:  # no group will have us: take the swarm's state right after this step (Trainer._catch_up)
            tr.found_late = True
            return _Done(RoundOutcome(fragment, round_, "behind", group_size=1, error=why))
        return tr.swarm.run_round(fragment=fragment, round_=round_, delta=delta, weight=weight, inner_step=step,
                                  target_group_size=tr.peers_seen)
