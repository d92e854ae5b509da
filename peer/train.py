"""The training loop: the one place that composes model, data, inner loop, outer state and swarm.

One peer, per inner step: take a batch from its own shard, step AdamW. When the steps schedule
says fragment p is due (``(t - t_p) mod H == 0``), compute ``Delta = S_p - theta_p``, run the
round through the swarm and, when an aggregate arrived, apply it with the outer Nesterov step and
merge it into the local weights (issue 2: blocking, tau = 0). Progress is published to the DHT
every ``progress_period`` seconds. SIGINT/SIGTERM stop the loop between steps; a round in flight is
abandoned (nothing of it is applied) and the peer leaves the swarm cleanly.
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from peer.config import PeerConfig
from peer.data import make_source
from peer.dht_node import ensure_identity
from peer.events import EventLog, StatusLine, setup_logging
from peer.fragments import Fragment, partition
from peer.inner import InnerLoop
from peer.model import build_model, count_parameters
from peer.outer import FragmentState, NesterovSGD, apply_round
from peer.swarm import RoundOutcome, Swarm

log = logging.getLogger(__name__)


def fragment_offset(p: int, num_fragments: int, H: int) -> int:
    """``t_p = round(p * H / P)``: fragment p's phase in the steps schedule."""
    return round(p * H / num_fragments)


def due_round(step: int, p: int, num_fragments: int, H: int) -> Optional[int]:
    """The round fragment p syncs at after inner step ``step`` (1-based), or None if it is not due."""
    since = step - fragment_offset(p, num_fragments, H)
    return since // H if since > 0 and since % H == 0 else None


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
        # The DHT forks a process: start it before anything can initialize CUDA.
        self.swarm = Swarm(cfg.swarm, run_key=run_hash, codec=cfg.outer.codec, identity_path=str(cfg.identity_path))
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
            self.peers_seen = len(self.swarm.live_peers())
            if self.peers_seen >= want or time.monotonic() > deadline:
                break
            self.stop.event.wait(min(1.0, self.cfg.swarm.progress_period))
        log.info("%d peer(s) of this run visible (wanted %d); starting to train", self.peers_seen, want)

    def _train(self, label: str) -> int:
        cfg = self.cfg
        model, blocks, source, inner = self._build()
        fragments = partition(model, blocks, cfg.outer.fragment_blocks, cfg.outer.fragment_pattern)
        log.info("%d fragment(s) of %s elements (%s, %d blocks each)", len(fragments),
                 [f.numel for f in fragments], cfg.outer.fragment_pattern, cfg.outer.fragment_blocks)
        states = [FragmentState.from_params(f.flat()) for f in fragments]
        outer_opt = NesterovSGD(lr=cfg.outer.lr, momentum=cfg.outer.momentum)
        floor = getattr(source, "entropy_floor", None)
        status = StatusLine(cfg.run.status_interval, label)
        self._wait_for_peers()
        H, P = cfg.outer.sync_every, len(fragments)
        t_start = time.monotonic()
        tokens_total, window_tokens, window_t0 = 0, 0, time.monotonic()
        tok_s, step = 0.0, 0
        while not self.stop.event.is_set() and (cfg.run.max_steps == 0 or step < cfg.run.max_steps):
            batch = source.next_batch(cfg.data.batch_size, cfg.model.seq_len)
            stats = inner.step(batch)
            step += 1
            tokens_total += stats.tokens
            window_tokens += stats.tokens
            for st in states:
                st.tokens_since_sync += stats.tokens
            if step % cfg.run.log_every == 0:
                now = time.monotonic()
                tok_s, window_tokens, window_t0 = window_tokens / max(now - window_t0, 1e-9), 0, now
                self.events.emit("step", step=step, loss=stats.loss, ce=stats.ce, lr=stats.lr, tokens=tokens_total,
                                 tokens_per_second=tok_s, elapsed=now - t_start, floor=floor)
            self.swarm.update_progress(step, states[0].round, tok_s)
            for p, (frag, st) in enumerate(zip(fragments, states)):
                r = due_round(step, p, P, H)
                if r is not None and not self.stop.event.is_set():
                    self._sync(frag, st, r, step, outer_opt, label)
            next_sync = min(fragment_offset(p, P, H) + (due_round_floor(step, p, P, H) + 1) * H for p in range(P))
            status.maybe_show(step=step, loss=stats.ce, floor=floor, tok_s=tok_s, peers=self.peers_seen,
                              next_sync=next_sync, up=self.bytes_up, down=self.bytes_down)
        reason = "stop signal" if self.stop.event.is_set() else f"max_steps={cfg.run.max_steps}"
        log.info("stopping after step %d (%s); %d rounds applied", step, reason, self.rounds_done)
        self.events.emit("stop", step=step, reason=reason, rounds=self.rounds_done, tokens=tokens_total)
        return 0

    def _sync(self, frag: Fragment, st: FragmentState, r: int, step: int, outer_opt: NesterovSGD,
              label: str) -> None:
        """One blocking round of fragment ``frag`` (tau = 0): launch, wait, apply what arrived."""
        cfg = self.cfg
        try:
            self.peers_seen = max(1, len(self.swarm.live_peers()))
        except Exception as e:  # DHT hiccup: keep the last known count
            log.debug("live peer lookup failed: %s", e)
        if self.peers_seen < cfg.swarm.min_group_size:
            # Alone in the run: no group can form; keep the progress for the next round, don't wait.
            st.round = r
            log.info("%s fragment %d round %d: skipped, %d live peer(s) < min_group_size %d", label, frag.index,
                     r, self.peers_seen, cfg.swarm.min_group_size)
            self.events.emit("round", fragment=frag.index, round=r, step=step, status="alone", group_size=1,
                             bytes_sent=0, bytes_received=0, seconds=0.0, digest=st.digest(), spans_applied=0,
                             spans_missing=0, weight=float(st.tokens_since_sync), contributors=[], error="")
            return
        theta = frag.flat()
        delta = st.outer_gradient(theta)
        weight = float(max(st.tokens_since_sync, 1))
        fut = self.swarm.run_round(fragment=frag.index, round_=r, delta=delta, weight=weight, inner_step=step,
                                   target_group_size=self.peers_seen)
        deadline = time.monotonic() + cfg.swarm.matchmaking_timeout + cfg.swarm.allreduce_timeout + 10
        outcome: Optional[RoundOutcome] = None
        while outcome is None and time.monotonic() < deadline:
            if self.stop.event.is_set():
                fut.cancel()
                log.info("%s fragment %d round %d: abandoned on stop (nothing applied)", label, frag.index, r)
                return
            try:
                outcome = fut.result(timeout=0.2)
            except TimeoutError:
                continue
        if outcome is None:
            fut.cancel()
            outcome = RoundOutcome(frag.index, r, "failed", error="round did not finish within its timeouts")
        st.round = r
        applied = [s for s in outcome.spans if s.average is not None]
        if applied:
            frag.assign(apply_round(st, theta, outcome.spans, outer_opt, cfg.outer.alpha))
            st.tokens_since_sync = 0
            st.applied_rounds.append(r)
            self.rounds_done += 1
        self.bytes_up += outcome.traffic.sent
        self.bytes_down += outcome.traffic.received
        digest = st.digest()
        missing = len(outcome.spans) - len(applied)
        msg = (f"{label} fragment {frag.index} round {r}: {outcome.status}, group {outcome.group_size}, "
               f"{len(applied)}/{len(outcome.spans)} spans applied, up {outcome.traffic.sent} B down "
               f"{outcome.traffic.received} B in {outcome.seconds:.2f}s, digest {digest[:12]}")
        (log.info if outcome.status == "ok" else log.warning)(msg + (f" ({outcome.error})" if outcome.error else ""))
        self.events.emit("round", fragment=frag.index, round=r, step=step, status=outcome.status,
                         group_size=outcome.group_size, bytes_sent=outcome.traffic.sent,
                         bytes_received=outcome.traffic.received, seconds=outcome.seconds, digest=digest,
                         spans_applied=len(applied), spans_missing=missing, weight=weight,
                         contributors=outcome.contributors, error=outcome.error)


def due_round_floor(step: int, p: int, num_fragments: int, H: int) -> int:
    """Rounds of fragment p already due by ``step`` (0 before its first sync)."""
    return max(0, (step - fragment_offset(p, num_fragments, H)) // H)
