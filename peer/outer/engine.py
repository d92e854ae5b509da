"""The Streaming DiLoCo outer engine of one peer: launch, overlap tau, eager updates, merge.

Pure torch; the network is behind a :class:`Transport`, so the same engine runs in the swarm
(``peer/run/trainer.py``) and in the simulator (``peer/outer/simulator.py``). Per inner step the caller runs
:meth:`StreamingEngine.launch_due` then :meth:`StreamingEngine.apply_due`. Modes (docs/algorithm.md 4-5):
``0 <= tau < H`` (Streaming DiLoCo Alg. 2, with the eager jump ``E`` when ``tau > 0`` and eager is on) applies a
round ``tau`` steps after its launch; ``tau = H`` (the eager paper's one-outer-step overlap) applies round r at
the next sync of its fragment, with ``S = G + E`` equal to Alg. 3's per-replica outer parameters.

Invariants: only an ``ok`` round changes ``G`` and ``v`` (:meth:`RoundOutcome.applied_spans`); any other status
undoes the eager jump and leaves the progress in ``S - theta`` and its tokens for the next round, except
``off_base`` (our part was averaged into another base: the trainer downloads the group's result). Every launch
declares its base, ``(round, digest)`` of the state the round is applied to. docs/architecture.md, "Overlap,
merge and eager updates", and "Failure semantics".
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional

import torch

from peer.outer.codec import Codec
from peer.outer.eager import Eager
from peer.outer.device_state import DeferredLaunch, DeviceState, Staged, to_host
from peer.outer.feedback import Feedback
from peer.outer.fragments import Fragment
from peer.outer.inflight import Handover, Pending, Prepared, Waits
from peer.outer.offload import (HostBuffers, OuterWorker, device_of, difference, gather, scatter, snapshot,
                                to_device)
from peer.outer import saved_state
from peer.outer.rounds import Handle, RoundOutcome, RoundStatus, Transport
from peer.outer.state import (FragmentState, NesterovSGD, advanced, blend, block_digests, merge_into,
                               merge_target)
from peer.outer.schedule import ClockSchedule, StepsSchedule, rolling_copies
from peer.outer.settings import OuterSettings

log = logging.getLogger(__name__)


class StreamingEngine:
    """Outer state and round bookkeeping of one peer. Create after the model's initial weights are
    set (identically on every peer); call :meth:`launch_due` then :meth:`apply_due` after each step."""

    def __init__(self, fragments: list[Fragment], settings: OuterSettings, transport: Transport, *,
                 group_size_hint: Callable[[], int] = lambda: 1, stop: Optional[threading.Event] = None,
                 on_outcome: Callable[[Fragment, FragmentState, RoundOutcome, int], None] = lambda *a: None,
                 error_feedback_codec: Optional[Codec] = None, tau_fn: Optional[Callable[[], int]] = None,
                 schedule: Optional[StepsSchedule | ClockSchedule] = None,
                 on_wait: Callable[[], None] = lambda: None, digest_of: Optional[Callable[[int], str]] = None,
                 state_on_device: "bool | str | None" = None, device_reserve: int = 0):
        """``digest_of(p)``: the digest of fragment p's ``G, v`` as they are now (default: hashed here; the trainer
        passes the one it published after the last change). ``state_on_device``: launch and apply on the parameters'
        device from a copy of ``G, v`` there (peer/outer/device_state.py), of every fragment (True) or of those in
        flight ("rolling"); None: on CUDA where the device has room beyond ``device_reserve`` bytes, in the
        streaming modes (tau = H keeps the host path)."""
        self.fragments = fragments
        self.cfg = settings
        self.transport = transport
        self.opt = NesterovSGD(lr=settings.lr, momentum=settings.momentum)
        self.pending: list[list[Pending]] = [[] for _ in fragments]
        self.stop = stop or threading.Event()
        self.on_outcome = on_outcome
        self.schedule = schedule or StepsSchedule(settings.H, len(fragments))
        self.states = [FragmentState.from_params(f.flat(), self._eager_terms(), E_in_sync_point=self.one_outer_step)
                       for f in fragments]
        self.tau_fn = tau_fn  # tau = auto: asked at each launch; returns 0 to H - 1 (settings.AutoTau, clamp_tau)
        self.worker = OuterWorker()  # the host math of arrived aggregates and error feedback (stopped by close)
        # optional error feedback: the codec's rounding error of what we sent is added to our next Delta
        self.feedback = (Feedback(len(fragments), error_feedback_codec, self.worker)
                         if error_feedback_codec is not None else None)
        self.handover = Handover(self.worker, self._prepare)  # (the one writer of a round's prepared aggregate)
        # the waits for aggregates, timed; on_wait is called about every 0.2 s while blocked (the trainer's status)
        self.waits = Waits(self.handover, timeout=settings.wait_timeout, stop=self.stop, on_wait=on_wait)
        self.digest_of = digest_of or (lambda p: self.states[p].digest())
        # the launches' fragment-sized host vectors, reused (see _retire): a snapshot and Delta per round in flight
        device = device_of(fragments[0]) if fragments else torch.device("cpu")
        self.device_state = DeviceState.choose(device, [f.numel for f in fragments], state_on_device,
                                               eligible=not self.one_outer_step, worker=self.worker,
                                               reserve=device_reserve, residual=self.feedback is not None,
                                               copies=rolling_copies(self._longest_tau(), settings.H, len(fragments)))
        if self.feedback is not None and self.device_state is not None:  # (its residuals are added there)
            self.feedback.mirror = self.device_state.mirror
        self._upcoming = 0  # the fragment to launch next (both schedules launch them in turn)
        # the device path pools only Delta's host copy, which the device writes (waited for) and never reads
        self.buffers = HostBuffers(max((f.numel for f in fragments), default=0), pinned=device.type == "cuda",
                                   keep=2 * len(fragments) + 1,
                                   device_reads=device.type == "cuda" and self.device_state is None)
        if self.device_state is not None:  # (allocated and uploaded now, at the start, not at the first launches)
            self.buffers.give(self.buffers.take(self.buffers.numel))
            for p, st in enumerate(self.states):
                if not self.device_state.rolling:
                    self.device_state.current(p, st.G, st.v)
            if fragments:
                self.device_state.prefetch(0, self.states[0].G, self.states[0].v)
                if self.feedback is not None:
                    self.feedback.prefetch(0)
        # our share of each round, and the eager jump it scales (peer/outer/eager.py)
        self.eager = Eager(fragments, self.opt, self.buffers, alpha=settings.alpha, replay=settings.merge == "replay",
                           group_size_hint=group_size_hint)
        # the device path's launches, handed to the transport once Delta is on the host (stopped by close)
        self._launcher = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-launch")
                          if self.device_state is not None else None)

    def close(self) -> None:
        """Stops the engine's threads (its state stays readable). Must be called once the engine is done."""
        self.worker.close()
        if self._launcher is not None:
            self._launcher.shutdown(wait=True, cancel_futures=True)

    def _longest_tau(self) -> int:
        """The longest overlap a round may have: ``tau``, or with ``tau = auto`` its bound."""
        return self.cfg.tau if self.tau_fn is None else min(self.cfg.H - 1, getattr(self.tau_fn, "tau_max", self.cfg.H))

    @property
    def one_outer_step(self) -> bool:
        """tau = H on the steps schedule: the eager paper's one-outer-step overlap."""
        return self.cfg.tau == self.cfg.H and isinstance(self.schedule, StepsSchedule)

    def add_tokens(self, tokens: int) -> None:
        for st in self.states:
            st.tokens_since_sync += tokens

    def expected_round(self, p: int) -> int:
        """The last round of fragment ``p`` our state will have applied once the rounds in flight land."""
        return max([self.states[p].last_applied] + [pend.round for pend in self.pending[p]])

    # ---- phase 1 ---------------------------------------------------------------------------
    def launch_due(self, step: int) -> None:
        """Launches every fragment whose round is due after inner step ``step`` (and hands the aggregates that
        are in to the worker, see :meth:`_prefetch`)."""
        self._prefetch()
        for p, (frag, st) in enumerate(zip(self.fragments, self.states)):
            r = self.schedule.due(step, p)
            if r is None or self.stop.is_set():
                continue
            if self.pending[p] and not self.one_outer_step:
                # clock schedule, rounds shorter than tau steps: S still excludes the round in flight,
                # so a new Delta would send that progress twice. Skip; it is carried to the next one.
                log.info("fragment %d round %d: skipped, round %d still in flight", p, r, self.pending[p][-1].round)
                continue
            if self.device_state is not None:
                self._launch_on_device(p, r, step)
                continue
            # Synchronous: the eager jump below needs theta at this step before the next update, and a round the
            # transport keeps home is reported at once (docs/architecture.md, "Off the training thread").
            theta, delta = self._outer_gradient(p)
            weight = float(max(st.tokens_since_sync, 1))
            st.tokens_since_sync = 0
            residual_before = None if self.feedback is None else self.feedback.compensate(p, delta)
            base: concurrent.futures.Future[tuple[int, str]] = concurrent.futures.Future()
            if not self.pending[p]:  # (tau = H: the previous round in flight is applied first, see _apply_next)
                base.set_result((st.last_applied, self.digest_of(p)))
            handle = self.transport.launch(fragment=p, round_=r, delta=delta, weight=weight, step=step,
                                           expected_round=self.expected_round(p), base=base)
            if not self.one_outer_step and handle.done() and self._not_launched(p, r, weight, handle, step):
                base.cancel()
                self.buffers.give(theta, delta)  # (the transport is done with it)
                continue
            if self.feedback is not None:  # what the peers will decode
                self.feedback.sent(p, delta)
            tau = self.cfg.tau if self.tau_fn is None else self.tau_fn()
            jump = None
            if self.cfg.eager and 0 < tau < self.cfg.H:
                jump, theta = self.eager.jump(p, theta, delta, st.G, st.v)
            theta_at_launch = theta if self.cfg.merge == "replay" else None
            if jump is None and theta_at_launch is None:
                self.buffers.give(theta)
            pend = Pending(r, step, delta, weight, handle, tau, theta_at_launch, jump,
                           residual_before=residual_before, base=base)
            self.pending[p].append(pend)
            if not self.one_outer_step:
                self.handover.on_arrival(pend, st.G, st.v, None)

    def _outer_gradient(self, p: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The host path's ``Delta = S - theta`` in a pooled vector, and ``theta`` in another where it was copied:
        parameters on the CPU with ``S = G`` are read where they are (``theta`` None: :meth:`Eager.jump` reads them
        there too) unless the replay merge keeps them; others are snapshotted first."""
        frag, st = self.fragments[p], self.states[p]
        delta = self.buffers.take(frag.numel)
        if device_of(frag).type == "cpu" and st.sync_point() is st.G and self.cfg.merge != "replay":
            return None, difference(frag, st.G, out=delta)
        theta = snapshot(frag, out=self.buffers.take(frag.numel)).wait()
        return theta, st.outer_gradient(theta, out=delta)

    def _launch_on_device(self, p: int, r: int, step: int) -> None:
        """The launch of the device path: every operation on the parameters' device is only enqueued; ``Delta``
        reaches the transport from the launch thread once it is on the host (peer/outer/device_state.py). A round
        the transport keeps home is reported at ``launch + tau`` (:meth:`_kept_home`)."""
        assert self.device_state is not None and self._launcher is not None
        frag, st = self.fragments[p], self.states[p]
        copy = self.device_state.current(p, st.G, st.v)
        theta = gather(frag)
        delta = torch.sub(copy.G, theta)
        residual_before = None if self.feedback is None else self.feedback.compensate(p, delta)
        weight = float(max(st.tokens_since_sync, 1))
        st.tokens_since_sync = 0
        base: concurrent.futures.Future[tuple[int, str]] = concurrent.futures.Future()
        base.set_result((st.last_applied, self.digest_of(p)))  # (no round of p is in flight: see launch_due)
        host = self.buffers.take(frag.numel)
        expected = self.expected_round(p)
        copied = to_host(delta, host)
        handle = DeferredLaunch(self._launcher, copied, lambda: self.transport.launch(
            fragment=p, round_=r, delta=host, weight=weight, step=step, expected_round=expected, base=base))
        if self.feedback is not None:  # (a round kept home puts the residual back: _kept_home)
            self.feedback.sent(p, host, copied)
        tau = self.cfg.tau if self.tau_fn is None else self.tau_fn()
        jump = None
        if self.cfg.eager and 0 < tau < self.cfg.H:
            jump, jumped = self.eager.jump(p, theta, delta, copy.G, copy.v)
            theta = theta if jumped is None else jumped  # (never None: theta is given)
        theta_at_launch = theta if self.cfg.merge == "replay" else None
        pend = Pending(r, step, host, weight, handle, tau, theta_at_launch, jump, residual_before=residual_before,
                       base=base)
        self.pending[p].append(pend)
        self.handover.on_arrival(pend, st.G, st.v, copy)
        self._upcoming = (p + 1) % len(self.fragments)
        upcoming = self.states[self._upcoming]
        self.device_state.prefetch(self._upcoming, upcoming.G, upcoming.v)  # (rolling: on its way from now)
        if self.feedback is not None:
            self.feedback.prefetch(self._upcoming)

    def _not_launched(self, p: int, r: int, weight: float, handle: Handle, step: int) -> bool:
        """Reports at once a round the transport decided not to launch (alone, or the swarm is past it): nothing
        of it is in flight, so nothing is jumped to or applied, its tokens and error-feedback residual are kept
        for the next round, and whoever reacts to its status (a catch-up) does so now, not ``tau`` steps later.
        Returns False for a round that was launched (it is applied at ``launch + tau`` as usual)."""
        outcome = handle.result(timeout=0)
        if RoundStatus(outcome.status).launched:
            return False
        self._forget(p, weight, None)
        self._report_home(p, r, step, outcome, step)
        return True

    def _kept_home(self, p: int, pend: Pending, outcome: RoundOutcome, step: int) -> None:
        """A deferred launch (the device path) that the transport kept home, at its ``launch + tau`` (a fixed step,
        so the weights do not depend on when the launch thread ran): its eager jump undone, its tokens carried, then
        reported as :meth:`_not_launched` reports the host path's at once. ``pend`` is out of the queue."""
        pend.base.cancel()
        self._forget(p, pend.weight, pend.jump)
        self._restore_residual(p, pend, None)  # (the residual update of what was never sent is undone)
        self._retire(p, pend)
        self._report_home(p, pend.round, pend.launch_step, outcome, step)
        self._settle(p)

    def _report_home(self, p: int, r: int, launch_step: int, outcome: RoundOutcome, step: int) -> None:
        """Reports round ``r`` of fragment ``p``, which the transport kept home, its progress already carried
        (:meth:`_forget`): the fragment's round moves on, and whoever reacts to the status (a catch-up) does."""
        self.states[p].round = r
        outcome.launch_step = launch_step
        self.on_outcome(self.fragments[p], self.states[p], outcome, step)

    # ---- phase 2 ---------------------------------------------------------------------------
    def apply_due(self, step: int) -> None:
        """Applies every aggregate due at ``step`` (launch + tau); blocks up to wait_timeout for it."""
        self._prefetch()
        for p, queue in enumerate(self.pending):
            while queue and queue[0].launch_step + queue[0].tau <= step:
                if self.one_outer_step and queue[0].launch_step + queue[0].tau < step:
                    break  # tau = H: applied at the next event only (it has the fresh Delta)
                if self.one_outer_step and len(queue) < 2:
                    break
                self._apply_next(p, step)
        if self.one_outer_step:
            self._first_events(step)

    def drain(self, step: int) -> None:
        """Applies every round in flight now instead of at its ``launch + tau`` (before a pause or a finish: the
        rounds complete, and nothing of our progress is left in flight); each waits up to ``wait_timeout`` for its
        aggregate, as in :meth:`apply_due`. With ``tau = H`` a round is applied with the next round's Delta, which
        does not exist yet: those are abandoned (their progress is carried). Must be called between steps."""
        if self.one_outer_step:
            self.abandon()
            return
        for p, queue in enumerate(self.pending):
            while queue:
                self._apply_next(p, step)

    def _apply_next(self, p: int, step: int) -> None:
        """Waits for fragment ``p``'s oldest round in flight and applies it (reported to ``on_outcome``)."""
        queue = self.pending[p]
        pend = queue.pop(0)
        replaced: list = [self.states[p].G, self.states[p].v]  # (freed by the worker, see the end)
        outcome = self.waits.outcome(pend, p) if pend.prepared is None else None
        # (a done callback may have handed it to the worker while we waited)
        prepared = self.waits.prepared(self.handover.retire(pend))
        outcome = prepared.outcome if prepared is not None else outcome
        assert outcome is not None
        if not RoundStatus(outcome.status).launched:  # (a deferred launch, kept home)
            self._kept_home(p, pend, outcome, step)
            return
        outcome.launch_step = pend.launch_step
        ready = prepared.ready_at if prepared is not None else time.monotonic()  # (else prepared here, now)
        outcome.ready_seconds = max(outcome.seconds, ready - pend.launched_at)
        if self.one_outer_step:
            self._apply_one_outer_step(p, pend, queue[0], outcome)
        else:
            self._apply_streaming(p, pend, outcome, prepared)
        self.states[p].round = pend.round
        self.on_outcome(self.fragments[p], self.states[p], outcome, step)
        if queue and not queue[0].base.done():  # tau = H: the next round's base is the state now
            queue[0].base.set_result((self.states[p].last_applied, self.digest_of(p)))
        self._retire(p, pend)
        # the G, v this round replaced and its aggregate are freed on the worker, not here, once nothing else
        # holds them (a fragment of a 1B model: three 640 MB vectors, ~60 ms of this thread's time)
        replaced.append(outcome)
        del pend, prepared, outcome
        self.worker.release(replaced)
        self._settle(p)

    def _settle(self, p: int) -> None:
        """After a round of ``p`` left the queue: the rolling residency drops ``p``'s device copy where no round of
        it is in flight and it is not the next to launch."""
        if self.device_state is not None and not self.pending[p] and p != self._upcoming:
            self.device_state.release(p)

    def _retire(self, p: int, pend: Pending) -> None:
        """Gives a round's host vectors back to the pool once the round is over (applied, given up or forgotten):
        its jump (read by the engine only; a checkpoint's copy clones it) and its ``Delta`` where the transport
        answered (a round given up at its deadline may still be sending it) and the worker's error-feedback
        updates, which read it, have run."""
        self.handover.retire(pend)
        read = self.feedback is not None and not self.feedback.idle(p)  # (its update may still read Delta)
        self.buffers.give(pend.jump, pend.delta if pend.answered and not read else None)

    def _prefetch(self) -> None:
        """Hands every aggregate that is in but not yet due to the worker (streaming modes: the tau = H machine
        applies with the next round's Delta) where no done callback has (:meth:`Handover.on_arrival`). Must be
        called on the training thread."""
        if self.one_outer_step:
            return
        for p, queue in enumerate(self.pending):
            for pend in queue:
                if pend.prepared is None and pend.handle.done():
                    st = self.states[p]
                    self.handover.submit(pend, pend.handle.result(timeout=0), st.G, st.v, self._copy(p))

    def _copy(self, p: int) -> Optional[Staged]:
        """The device path's copy of fragment p's ``G, v`` as they are now (None on the host path)."""
        st = self.states[p]
        return None if self.device_state is None else self.device_state.current(p, st.G, st.v)

    def _prepare(self, outcome: RoundOutcome, base: torch.Tensor, base_v: torch.Tensor,
                 copy: Optional[Staged]) -> Prepared:
        """The aggregate applied to copies of ``G, v`` (the worker, or the training thread where it came late): on
        the host, or on the device from ``copy`` (their copy there) on the device path."""
        if copy is not None and self.device_state is not None:
            staged, v, applied = self.device_state.advance(copy, outcome.applied_spans(), self.opt)
            G = staged.host_G
            return Prepared(outcome, base, G, v, applied, G, block_digests(G, v), staged.applied is None, staged)
        G, v, applied = advanced(base, base_v, outcome.applied_spans(), self.opt)
        return Prepared(outcome, base, G, v, applied, merge_target(G, self.cfg.alpha, self.cfg.merge == "replay"),
                        block_digests(G, v), bool(applied.all()))

    def _first_events(self, step: int) -> None:
        # Alg. 3 applies nothing at its first sync (t = H): the replica keeps its local weights as the
        # start of the next phase; E holds that divergence from the shared G.
        for p, queue in enumerate(self.pending):
            if len(queue) == 1 and queue[0].round == 1 and queue[0].launch_step == step:
                st, theta = self.states[p], self.fragments[p].flat()
                st.E = theta - st.G  # the phase starts from theta = G + E (sync_point)

    def _apply_streaming(self, p: int, pend: Pending, outcome: RoundOutcome, prepared: Optional[Prepared]) -> None:
        """state.apply_round's two halves: the shared state (prepared ahead where the aggregate came early), then
        the merge, computed where the parameters are (no copy of them to the host), and the eager undo."""
        frag, st = self.fragments[p], self.states[p]
        delivered = outcome.status == RoundStatus.OFF_BASE  # (our part is in the group's result: not sent again)
        if prepared is None and all(span.average is None for span in outcome.applied_spans()):
            # nothing arrived (missed, failed, ...): G, v stay the same tensors (no copy, no new digest), the eager
            # jump is undone and the progress carried, as the general case below would do
            self._forget(p, 0 if delivered else pend.weight, pend.jump)
            if not delivered:
                self._restore_residual(p, pend, torch.ones(frag.numel, dtype=torch.bool))
            return
        if prepared is None or prepared.base is not st.G:
            prepared = self._prepare(outcome, st.G, st.v, self._copy(p))
        st.G, st.v, applied = prepared.G, prepared.v, prepared.applied
        st.remember_blocks(prepared.blocks)
        device = device_of(frag)
        replay = pend.theta_at_launch if self.cfg.merge == "replay" else None
        target, arrived = prepared.target, None
        if prepared.staged is not None and self.device_state is not None:  # (the device path: G is there)
            staged = self.device_state.install(p, prepared.staged)
            target = merge_target(staged.G, self.cfg.alpha, replay is not None)
            arrived = staged.applied
        if prepared.whole and self.cfg.alpha == 0.0 and replay is None:
            # (the default) every element arrived: theta <- G, the merge's value, with nothing left to undo
            scatter(frag, target)
        else:
            theta = gather(frag)
            merge_into(theta, to_device(target, device), outcome.applied_spans(), self.cfg.alpha,
                       replay_from=None if replay is None else to_device(replay, device))
            if pend.jump is not None and not prepared.whole:  # nothing arrived there: undo the jump, keep progress
                missing = ~to_device(applied if arrived is None else arrived, device)
                theta = torch.where(missing, theta - to_device(pend.jump, device), theta)
            scatter(frag, theta)
        if not prepared.whole and not delivered:
            self._restore_residual(p, pend, ~applied)
        if prepared.whole or bool(applied.any()):
            st.applied_rounds.append(pend.round)
            self.eager.record(p, pend.weight, outcome.total_weight)
        elif not delivered:
            st.tokens_since_sync += int(pend.weight)

    def _apply_one_outer_step(self, p: int, prev: Pending, fresh: Pending, outcome: RoundOutcome) -> None:
        frag, st = self.fragments[p], self.states[p]
        arrived = [(s, s.average) for s in outcome.applied_spans() if s.average is not None]
        if arrived:  # (G, v are replaced, never written in place: see FragmentState)
            G, v = st.G.clone(), st.v.clone()
            for span, average in arrived:
                sl = slice(span.start, span.end)
                self.opt.step_(G[sl], v[sl], average)
            st.G, st.v = G, v
            self.eager.record(p, prev.weight, outcome.total_weight)
        if self.cfg.eager and st.E is not None and st.u is not None:
            self.opt.step_(st.E, st.u, self.eager.share(p) * (fresh.delta - prev.delta))
        frag.assign(blend(frag.flat(), st.sync_point(), self.cfg.alpha))  # the next phase starts there
        if arrived:
            st.applied_rounds.append(prev.round)

    def abandon(self) -> None:
        """Gives up every round in flight (on stop): nothing of them is applied, the eager jumps are
        undone and their tokens carried, so their progress is in ``S - theta`` for a later round."""
        for p, queue in enumerate(self.pending):
            oldest = queue[0] if queue else None
            for pend in queue:
                pend.handle.cancel()
                pend.base.cancel()
                self._forget(p, pend.weight, pend.jump)
            given_up = list(queue)
            queue.clear()
            if oldest is not None:
                self._restore_residual(p, oldest, None)
            for pend in given_up:
                self._retire(p, pend)

    def _restore_residual(self, p: int, pend: Pending, where: Optional[torch.Tensor]) -> None:
        """Puts back the error-feedback residual from before ``pend``'s launch where its round delivered nothing
        (``where``: a mask; None: everywhere, the oldest round in flight of ``p`` given up). Only while no later
        round of ``p`` is in flight: that one's residual was computed on top of this one's."""
        if self.feedback is not None and all(q is pend for q in self.pending[p]):
            self.feedback.restore(p, pend.residual_before, where)

    def _forget(self, p: int, weight: float, jump: Optional[torch.Tensor]) -> None:
        st, frag = self.states[p], self.fragments[p]
        if jump is not None:
            frag.assign(gather(frag) - to_device(jump, device_of(frag)))
        st.tokens_since_sync += int(weight)

    def adopt(self, p: int, G: torch.Tensor, v: torch.Tensor, round_: int,
              blocks: Optional[list[bytes]] = None) -> None:
        """Replaces fragment p's shared state by the swarm's (downloaded) one and resets the local
        weights to it; rounds of p in flight are forgotten. Local progress on p is dropped: it was made
        from a state the swarm no longer holds. ``blocks``: the state's block digests, where they were
        verified (a download)."""
        for pend in self.pending[p]:
            pend.handle.cancel()
            pend.base.cancel()
            self._retire(p, pend)
        self.pending[p].clear()
        st = self.states[p]
        st.G, st.v = G.clone(), v.clone()
        if blocks:
            st.remember_blocks(blocks)
        st.reset_eager()
        st.round, st.tokens_since_sync = round_, 0
        st.applied_rounds = [round_]
        if self.feedback is not None:  # the residual of dropped progress goes with it
            self.feedback.reset(p)
        self.fragments[p].assign(G)

    def _eager_terms(self) -> tuple[str, ...]:
        """The per-peer terms this peer's settings keep between rounds, with tau = H only: E, the divergence from
        G, and with eager updates u, the eager machine's momentum. Otherwise neither is allocated nor saved (an
        eager jump with tau < H is kept with its round in flight: :class:`Pending`'s ``jump``)."""
        return ((("E",) if self.one_outer_step else ())
                + (("u",) if self.cfg.eager and self.one_outer_step else ()))

    def immutable_tensors(self) -> list[torch.Tensor]:
        """The tensors of the outer state that are replaced, never written in place (every fragment's ``G`` and
        ``v``: see FragmentState): a copy of :meth:`state_dict` may hold them as they are."""
        return [t for st in self.states for t in (st.G, st.v)]

    def state_dict(self) -> dict:
        """Outer state for a checkpoint (:func:`peer.outer.saved_state.save`)."""
        return saved_state.save(self.states, self.pending, self.eager.last_share, self.feedback,
                                ("G", "v") + self._eager_terms())

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` (:func:`peer.outer.saved_state.restore`). Must be called after the model
        weights were restored; rounds that were in flight count as missed (eager jump undone, tokens carried)."""
        self.eager.last_share = saved_state.restore(state, self.states, self.feedback, self._eager_terms())
        for p, queue in enumerate(state["pending"]):
            for pend in queue:
                self._forget(p, pend["weight"], pend["jump"])
