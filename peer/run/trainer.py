"""The training loop: the one place that composes model, data, inner loop, outer state and swarm.

One peer, per inner step: take a batch from its own shard, step AdamW, then let the
:class:`~peer.outer.engine.StreamingEngine` launch the fragments that are due (``(t - t_p) mod H == 0``)
through the swarm and apply the aggregates that are due (``launch + tau``). The swarm's heartbeat
publishes our progress. SIGINT/SIGTERM stop the loop between steps; a round in flight is abandoned
(nothing of it is applied) and the peer leaves the swarm cleanly.

Before joining the swarm the peer locks its run dir (one process per run dir) and checks what the user
can fix (device, model contract, data: :mod:`peer.run.preflight`), so those fail in one line before any
other peer waits for this one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any, Optional

from hivemind.utils import get_dht_time

from peer.run import preflight
from peer.outer.codec import get_codec, make_codec, warm_up
from peer.config import PeerConfig
from peer.errors import JoinError, SetupError
from peer.control.controls import PeerState
from peer.run.evaluation import SharedEval
from peer.run.events import EventLog, setup_logging
from peer.run.figures import Figures
from peer.run.ledger import RoundLedger
from peer.run.outcomes import RoundReports
from peer.run.catch_up import StateSync
from peer.run.pace import PaceWatch
from peer.run.resume import RunCheckpoints
from peer.run.owner import REST_SLICE_S, OwnerLink, StopFlag
from peer.run.phase import PhaseKeeper
from peer.outer.fragments import partition
from peer.outer.offload import device_of
from peer.run.local_build import build_local, outer_state_reserve
from peer.run.run_dir import RunDirLock
from peer.outer.schedule import ClockSchedule, StepsSchedule
from peer.net.round.levels import PART_CODEC
from peer.net.transport import SwarmTransport
from peer.net.trust.records import MAX_FRAGMENTS
from peer.outer.aggregate import AggregationRule
from peer.outer.engine import StreamingEngine
from peer.outer.settings import AutoTau, OuterSettings
from peer.run.status import StatusLine
from peer.net.swarm import Swarm
from peer.net.flow.bandwidth import Bandwidth
from peer.util import short_id, thread_cpu_seconds

log = logging.getLogger(__name__)


def shard_of(peer_id: str) -> int:
    """The data shard a peer reads when ``data.shard`` is -1: derived from its peer id."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little")


EXIT_PASS_ENDED = 2  # our pass was revoked or expired: a setup to fix (a new pass), like a pass that is missing


class Trainer:
    """Runs one peer until ``max_steps`` or a stop signal. Create, then call :meth:`run` once.

    Its fields are written by the training thread only (the thread that calls :meth:`run`); the control API's
    threads read plain values of what the owner sees through :class:`~peer.run.figures.Figures`."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.run_dir)
        self.stop = StopFlag()
        self.run_hash = ""
        self.events = EventLog(None)  # opened in run(), once the run dir is ours
        self.ledger = RoundLedger(self.events, aggregator=cfg.outer.aggregator)  # rounds counted and told
        self.figures = Figures(cfg, self.ledger, self.events)  # what the owner sees: status line, step event, API
        # the control API, the limits (started in _run)
        self.owner = OwnerLink(cfg, self.stop.event, figures=self.figures.snapshot)
        # Created here (nothing starts before run()); its DHT process forks, so run() starts it before any CUDA.
        codec = make_codec(cfg.outer.codec, stochastic_rounding=True) if cfg.outer.stochastic_rounding \
            else cfg.outer.codec
        self.codec = codec
        self.swarm: Swarm  # created in _run, once the identity (and, in an authenticated run, our pass) is checked
        self.pace = PaceWatch(schedule=cfg.outer.schedule)  # whether we keep the swarm's pace (said when not)
        self.checkpoints = RunCheckpoints(cfg, self.run_dir, self.events)
        self.engine: Optional[StreamingEngine] = None  # set in _train
        self.sync: StateSync  # our fragments' states against the swarm's: created in _train, with the engine
        self.reports: RoundReports  # what a round's outcome changes outside the engine: created with the sync
        self.evaluation: Optional[SharedEval] = None  # the shared model on held-out data: created in _train
        self.phase: Optional[PhaseKeeper] = None  # our phase against the swarm's (steps schedule): made in _build

    def run(self) -> int:
        """Trains; returns the process exit code (0 on max_steps or a stop signal).

        Raises :class:`~peer.errors.SetupError` (the run dir in use, a bad device, model or data, a
        checkpoint of another run) before joining, and :class:`~peer.errors.JoinError` if no initial peer
        answered."""
        lock = RunDirLock(self.run_dir)
        try:
            lock.acquire()
        except RuntimeError as e:
            raise SetupError(str(e)) from None
        try:
            return self._run()
        finally:
            lock.release()

    def _run(self) -> int:
        cfg = self.cfg
        peer_id = preflight.check_identity_and_addresses(cfg)
        label = f"peer {short_id(peer_id)}"
        setup_logging(cfg.run.log_level, self.run_dir / "peer.log", label)
        self.events.open(cfg.run.log_json, feed=self.owner.feed.publish)  # (the ledger's and checkpoints' too)
        self.stop.install(wake=self.owner.controls.wake)
        self.peer_id = self.figures.peer_id = peer_id
        try:
            return self._setup_and_train(peer_id, label)
        finally:
            self.owner.stop()

    def _setup_and_train(self, peer_id: str, label: str) -> int:
        cfg = self.cfg
        # Before joining the swarm: everything the user can fix is reported here, in one line. (The data first:
        # the run hash reads its manifest.)
        preflight.check_device(cfg.inner.device)
        preflight.check_model(cfg)
        source = preflight.open_data(cfg, cfg.data.shard if cfg.data.shard >= 0 else shard_of(peer_id))
        run_hash = self.run_hash = self.figures.run_hash = cfg.run_hash()
        log.info("resolved config (run hash %s): %s", run_hash, cfg.to_dict())
        self.checkpoints.find(run_hash)
        access = preflight.load_access(cfg)
        log.info("%s", preflight.describe_access(cfg, access))
        self.swarm = Swarm(cfg.swarm, run_key=run_hash, codec=self.codec, identity_path=str(cfg.identity_path),
                           rule=AggregationRule.from_config(cfg.outer), access=access,
                           bandwidth=Bandwidth(lambda: self.owner.controls.limits.get().byte_rates()),
                           on_exclude=lambda peer, why: self.events.emit("peer_excluded", peer=peer, reason=why),
                           claimed_path=str(Path(cfg.run.run_dir) / "claimed_rounds.json"))
        self.figures.swarm = self.swarm
        try:  # the DHT forks a process: start it before anything can initialize CUDA
            try:
                self.swarm.start(stop=self.stop.event)
            except JoinError:
                if not self.stop.event.is_set():
                    raise
                log.info("stopped before joining the swarm")  # Ctrl-C while the initial peers were retried
                return 0
            log.info("joined the swarm as %s; listening on %s", peer_id, " ".join(self.swarm.visible_maddrs()))
            # After the DHT process forked: gRPC's threads must not exist at a fork.
            self.owner.start(self.run_dir)
            self.events.emit("start", peer_id=peer_id, run_hash=run_hash, maddrs=self.swarm.visible_maddrs(),
                             config=cfg.to_dict())
            return self._train(label, source)
        finally:
            if self.engine is not None:
                self.engine.close()
            self.checkpoints.close()
            self.swarm.shutdown()
            self.events.close()
            log.info("left the swarm")

    def _wait_for_peers(self) -> None:
        """Blocks until ``min_peers`` peers of this run are visible, a stop signal, or start_timeout; in any case
        until the swarm's progress records were read once (bounded by ``progress_ttl``), so that the catch-up
        of a peer that comes back sees how far the others got (otherwise it launches rounds from its old
        state, and only finds out it is behind a round later). Then, within the same start_timeout and as long as
        no stop signal comes, until every visible peer our daemon did not list was greeted and the connections
        listed after (:meth:`Swarm.wait_settled`): until its first group a peer's votes are the records of the
        peers its daemon holds a connection with, and an attacker that dials every peer it sees would otherwise be
        the only one at the first catch-up."""
        want, deadline = self.cfg.swarm.min_peers, time.monotonic() + self.cfg.swarm.start_timeout
        if not self.swarm.wait_first_read(min(self.cfg.swarm.progress_ttl, self.cfg.swarm.start_timeout)):
            log.warning("the swarm's progress records could not be read within %.0f s; starting without them",
                        min(self.cfg.swarm.progress_ttl, self.cfg.swarm.start_timeout))
        seen = self.swarm.live_count()
        while want > 1 and not self.stop.event.is_set() and seen < want and time.monotonic() <= deadline:
            self.figures.show(f"waiting for peers ({seen}/{want} visible, up to {deadline - time.monotonic():.0f} s)")
            self.stop.event.wait(min(1.0, self.cfg.swarm.progress_period))
            seen = self.swarm.live_count()
        settled = self.swarm.wait_settled(0.0)
        while not settled and not self.stop.event.is_set() and time.monotonic() <= deadline:
            self.figures.show(f"greeting the visible peers (up to {deadline - time.monotonic():.0f} s)")
            settled = self.swarm.wait_settled(min(1.0, self.cfg.swarm.progress_period))
        if not settled and not self.stop.event.is_set():
            log.info("not every visible peer was greeted within swarm.start_timeout; starting with those that were")
        log.info("%d peer(s) of this run visible (wanted %d); starting to train", seen, want)

    def _train(self, label: str, source) -> int:
        """Trains from our checkpoint (or the start), in the swarm's state, until ``max_steps``, a stop signal, a
        finish or the end of our pass; returns the exit code. Each step: the inner step, the ``step`` event, the
        engine's launches and applies, the shared model's evaluation, the catch-up, the checkpoint."""
        cfg, controls = self.cfg, self.owner.controls
        parts = self._build(label, source)
        engine, inner = parts["engine"], parts["inner"]
        figures, status = self.figures, self.figures.status
        assert status is not None and self.evaluation is not None  # (made by _build)
        step = self._join(parts)
        controls.enter(PeerState.TRAINING)
        figures.last_step_at = time.monotonic()
        figures.throughput.restart()
        loop = figures.throughput.parts  # (where the loop's time goes: the step event's loop_seconds)
        while not self.stop.event.is_set() and (cfg.run.max_steps == 0 or step < cfg.run.max_steps):
            if self.swarm.pass_ended or controls.finish_requested:
                break
            if (why := controls.pause_reason()) is not None:
                step = self._pause(step, why, parts)
                loop.mark("pause")
                continue
            self.owner.apply_limits()
            step = self._realign(engine, step)
            loop.mark("controls")
            stats = inner.step(source.next_batch(cfg.data.batch_size, cfg.model.seq_len))
            step_seconds = loop.mark("step")
            figures.last_step_at = loop.last
            step = figures.step = step + 1
            if step % cfg.run.log_every == 0 or status.due():  # the loss waits for the device: not every step
                figures.loss = stats.ce  # (raises FloatingPointError if a step since the last read was not finite)
            figures.throughput.observe(stats.tokens, step_seconds)
            engine.add_tokens(stats.tokens)
            if step % cfg.run.log_every == 0:
                figures.log_step(step, stats, engine)
            self.swarm.ours.update_progress(step, engine.states[0].round, figures.throughput.tokens_per_second,
                                       figures.loss)
            loop.mark("figures")
            engine.launch_due(step)
            loop.mark("launch")
            engine.apply_due(step)
            loop.mark("apply")
            self.evaluation.maybe(engine.states, self.sync.digest)
            loop.mark("evaluation")
            if self.sync.due():
                step = self._catch_up(engine, step, joining=False)
            loop.mark("catch_up")
            self.checkpoints.save_if_due(step, rounds_done=self.ledger.done,
                                         applied=bool(engine.states[0].applied_rounds), **parts)
            loop.mark("checkpoint")
            if status.due():
                figures.show()
            self.owner.rest(step_seconds, figures.show)
            loop.mark("rest")
        return self._finish(step, parts)

    def _build(self, label: str, source) -> dict[str, Any]:
        """Makes what the loop composes: the model and its inner loop, the fragments, the outer engine and its
        transport through the swarm, the state sync, the shared model's evaluation and the status line. Returns
        the parts a checkpoint holds (``model``, ``inner``, ``source``, ``engine``)."""
        cfg = self.cfg
        model, blocks, inner = build_local(cfg, source)
        fragments = partition(model, blocks, cfg.outer.fragment_blocks, cfg.outer.fragment_pattern)
        if len(fragments) > MAX_FRAGMENTS:  # (a progress record carries a round and a digest per fragment)
            raise SetupError(f"outer.fragment_blocks: {cfg.outer.fragment_blocks} makes {len(fragments)} fragments; a "
                             f"run has at most {MAX_FRAGMENTS} (raise it)")
        log.info("%d fragment(s) of %s elements (%s, %d blocks each); codec %s, tau %s, eager %s, merge %s",
                 len(fragments), [f.numel for f in fragments], cfg.outer.fragment_pattern,
                 cfg.outer.fragment_blocks, cfg.outer.codec, cfg.outer.tau, cfg.outer.eager, cfg.outer.merge)
        step_time = self.figures.throughput.step_time
        auto_tau = self.figures.auto_tau = AutoTau(cfg.outer.tau_max, cfg.outer.sync_every, step_time) \
            if cfg.outer.tau == "auto" else None
        # the codecs' CPU kernels compile (or load from numba's cache) now, not in a round: the run's codec and,
        # where rounds may run in two levels, level 2's part codec (cold: seconds, past a part's deadline)
        codecs = [self.swarm.codec] + ([get_codec(PART_CODEC)] if cfg.swarm.group_cap else [])
        log.info("codec %s ready in %.1f s (its CPU kernels compiled or loaded before the first round)",
                 "+".join(c.name for c in codecs), sum(warm_up(c) for c in codecs))
        self.owner.note_traffic(max(f.numel for f in fragments), self.swarm.codec)
        settings = OuterSettings.from_config(cfg.outer)
        schedule = self._schedule(len(fragments))
        if isinstance(schedule, StepsSchedule):
            self.phase = self.figures.phase = PhaseKeeper(self.swarm, self.events, H=cfg.outer.sync_every,
                                                          patience=cfg.swarm.matchmaking_patience, step_time=step_time)
        transport = SwarmTransport(self.swarm, min_group_size=cfg.swarm.min_group_size,
                                   sync_every=cfg.outer.sync_every if isinstance(schedule, StepsSchedule) else None)
        engine = StreamingEngine(fragments, settings, transport, group_size_hint=lambda: transport.live_count,
                                 stop=self.stop.event, on_outcome=lambda *outcome: self.reports.round(*outcome),
                                 error_feedback_codec=get_codec(cfg.outer.codec) if cfg.outer.error_feedback else None,
                                 tau_fn=auto_tau, schedule=schedule, on_wait=self.figures.show,
                                 digest_of=lambda p: self.sync.digest(p),
                                 state_on_device={"auto": None, "on": True, "rolling": "rolling",
                                                  "off": False}[cfg.outer.state_on_device],
                                 device_reserve=outer_state_reserve(cfg, device_of(fragments[0])))
        self.engine = self.figures.engine = engine
        residency = engine.device_state
        log.info("outer state: on the host%s", "" if residency is None else
                 f", a copy {'of the fragments in flight ' if residency.rolling else ''}on {residency.device} "
                 "(launches and applies enqueue work there)")
        self.sync = StateSync(self.swarm, engine, events=self.events, pace=self.pace, stop=self.stop.event,
                              sync_every=cfg.outer.sync_every, on_fragment=self.owner.note_fragment,
                              show_status=self.figures.show, owed_timeout=4 * cfg.swarm.progress_period + 2,
                              drift_check_period=cfg.swarm.drift_check_period,
                              recheck_after=cfg.swarm.progress_period / 4)
        self.reports = RoundReports(label, self.peer_id, swarm=self.swarm, sync=self.sync, owner=self.owner,
                                    events=self.events, ledger=self.ledger, pace=self.pace, auto_tau=auto_tau)
        self.figures.floor = getattr(source, "entropy_floor", None)
        held = source.held_out(cfg.run.eval_sequences, cfg.model.seq_len) if cfg.run.eval_every else None
        if cfg.run.eval_every and held is None:
            log.info("the shared model will not be evaluated: data.holdout = %s holds out fewer tokens than one "
                     "sequence (model.seq_len + 1)", cfg.data.holdout)
        self.evaluation = self.figures.evaluation = SharedEval(
            inner, fragments, held, every=cfg.run.eval_every,
            report=lambda e: self.reports.evaluation(e, self.figures.step))
        self.figures.status = StatusLine(cfg.run.status_interval, label)
        self.figures.device = str(next(model.parameters()).device)
        return dict(model=model, inner=inner, source=source, engine=engine)

    def _join(self, parts: dict[str, Any]) -> int:
        """Restores our checkpoint (if any) and publishes our fragments' states, waits for the swarm's peers and
        catches up with its state; returns the step to train from."""
        engine, controls = parts["engine"], self.owner.controls
        step = self.figures.step = self.checkpoints.restore(**parts)
        for frag, st in zip(engine.fragments, engine.states):
            self.sync.publish(frag, st, step)
        controls.enter(PeerState.STARTING, "waiting for peers")
        self._wait_for_peers()
        controls.enter(PeerState.STARTING, "catching up with the swarm")
        return self._catch_up(engine, step, joining=True)

    def _finish(self, step: int, parts: dict[str, Any]) -> int:
        """After the loop: completes the rounds in flight (a finish, or ``max_steps``: the others launched their last
        rounds with ours) or abandons them, writes the last checkpoint and says why it stopped; returns the exit
        code."""
        cfg, controls, engine = self.cfg, self.owner.controls, parts["engine"]
        if controls.finish_requested and not self.stop.event.is_set():
            controls.enter(PeerState.FINISHING, "completing the rounds in flight")
            log.info("finishing (asked by the owner): completing the rounds in flight, then a checkpoint")
            engine.drain(step)
        elif self._reached_max_steps(step):  # the last rounds were launched with the others: complete them
            engine.drain(step)
        else:
            engine.abandon()
        self.checkpoints.save(step, **parts, wait=True)
        reason = "stop signal" if self.stop.event.is_set() else f"max_steps={cfg.run.max_steps}"
        if controls.finish_requested and not self.stop.event.is_set():
            reason = "finish requested"
        ended = self.swarm.pass_ended if not self.stop.event.is_set() else None
        if ended:
            reason = "pass ended"
            log.error("%s: no peer of the run works with it any more; ask the operator for a new pass "
                      "(swarm.pass_path). Progress is kept in the checkpoint", ended)
        log.info("stopping after step %d (%s); %d rounds applied", step, reason, self.ledger.done)
        cpu = thread_cpu_seconds()  # (whose CPU, and so whose GIL, the training thread shared)
        log.info("CPU seconds by thread: %s", ", ".join(f"{name} {s:.1f}" for name, s in sorted(cpu.items())))
        self.events.emit("stop", step=step, reason=reason, rounds=self.ledger.done,
                         tokens=self.figures.throughput.tokens, thread_cpu_s=cpu)
        return EXIT_PASS_ENDED if ended else 0

    # ---- the owner's controls ------------------------------------------------------------------
    def _reached_max_steps(self, step: int) -> bool:
        """The loop ended at ``run.max_steps`` (not a stop signal, a finish or the end of the pass): the peers
        that run the same number of steps launched their last rounds together, so they complete them."""
        max_steps = self.cfg.run.max_steps
        return (not self.stop.event.is_set() and not self.swarm.pass_ended and max_steps > 0
                and step >= max_steps)

    def _pause(self, step: int, why: str, parts: dict) -> int:
        """Pauses until the owner resumes (or the active hours begin), a stop or a finish; returns the step to
        go on from. Must be called between steps. The rounds in flight complete first and a checkpoint is
        written (a paused laptop may be closed); while paused our record says so, and no peer waits for us. On
        resuming we meet the swarm's state (catch-up) and, on the steps schedule, its phase (the realignment at
        the next step)."""
        engine, controls = parts["engine"], self.owner.controls
        controls.enter(PeerState.PAUSING, f"{why}; completing the rounds in flight")
        engine.drain(step)
        self.checkpoints.save(step, **parts, wait=True)
        self.swarm.ours.publish_paused(True)
        log.info("paused after step %d (%s): rounds in flight applied, checkpoint written; the swarm sees this peer "
                 "as paused", step, why)
        self.events.emit("pause", step=step, reason=why)
        controls.enter(PeerState.PAUSED, why)  # last: `swarm-peer pause --wait` returns on it
        t0 = time.monotonic()
        while not self.stop.event.is_set() and not controls.finish_requested and \
                (now_why := controls.pause_reason()) is not None:
            if now_why != why:
                why = now_why
                controls.enter(PeerState.PAUSED, why)
            self.figures.show(f"paused: {why}")
            if controls.wake.wait(REST_SLICE_S):
                controls.wake.clear()
        self.swarm.ours.publish_paused(False)
        paused_s = time.monotonic() - t0
        self.events.emit("pause_end", step=step, seconds=paused_s)
        if self.stop.event.is_set() or controls.finish_requested:
            return step
        log.info("resuming after %.0f s paused: meeting the swarm's state and phase", paused_s)
        controls.enter(PeerState.STARTING, "catching up with the swarm after a pause")
        step = self._catch_up(parts["engine"], step, joining=True)
        controls.enter(PeerState.TRAINING)
        self.figures.last_step_at = time.monotonic()
        return step

    # ---- phase -------------------------------------------------------------------------------
    def _catch_up(self, engine: StreamingEngine, step: int, **kw) -> int:
        """The state sync's catch-up (``kw``: :meth:`StateSync.catch_up`'s); after an adoption, also the phase: a
        snapshot's step is its donor's when it applied, and the swarm may have launched its next round since (a
        peer that then waits out its steps reaches that round after its group assembled, and downloads again)."""
        step = self.sync.catch_up(step, **kw)
        return self._realign(engine, step, min_lag_seconds=0.0) if self.sync.adopted else step

    def _realign(self, engine: StreamingEngine, step: int, min_lag_seconds: Optional[float] = None) -> int:
        """The step to continue from: on the steps schedule, moved up to meet the swarm when we are far behind it
        (:meth:`PhaseKeeper.realign`); our progress is kept."""
        return step if self.phase is None else self.phase.realign(engine.states, step, min_lag_seconds)

    def _schedule(self, num_fragments: int):
        cfg = self.cfg.outer
        if cfg.schedule == "clock":
            return ClockSchedule(cfg.round_seconds, num_fragments, origin=cfg.clock_origin, clock=get_dht_time)
        return StepsSchedule(cfg.sync_every, num_fragments)
