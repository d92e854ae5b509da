"""A round in flight: the hand-over of its aggregate to the engine's worker, and the training thread's wait for it.

:class:`Pending` is what a launch leaves for its apply at ``launch + tau``; :class:`Prepared` is the round's
aggregate applied to copies of the shared state by the worker, ahead of that step. :class:`Handover` is the one
writer of a round's ``prepared``, ``answered`` and ``retired``: the training thread (at step boundaries, and when it
takes a round out to apply or drop it) and the thread that completes a round (a done callback on its handle) both
go through it, under its lock, so an aggregate is handed to the worker at most once and never after its round
left the queue. :class:`Waits` is the training thread's wait for a round's outcome and prepared aggregate, timed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from peer.outer.device_state import Staged
from peer.outer.offload import OuterWorker
from peer.outer.rounds import Handle, RoundOutcome, RoundStatus
from peer.util import time_left


@dataclass
class Pending:
    """A round in flight: what was sent and what to undo if it never arrives."""

    round: int
    launch_step: int
    delta: torch.Tensor
    weight: float
    handle: Handle
    tau: int  # this round's overlap (fixed at launch; ``tau = auto`` may change between rounds)
    theta_at_launch: Optional[torch.Tensor]  # after the eager jump; kept for the replay merge only
    jump: Optional[torch.Tensor]  # the eager jump applied at launch (undone where nothing arrives)
    prepared: Optional[concurrent.futures.Future] = None  # the worker's Prepared, once the aggregate is in
    # error feedback: the residual before this launch, put back where nothing of the round arrives (what we sent
    # there was never received: its progress is carried in S - theta, and so must its residual be, once)
    residual_before: Optional[torch.Tensor] = None
    # (round, digest) of the state this round's average is applied to; resolved by the engine (tau = H: once the
    # previous round is applied), cancelled when that never happens
    base: "concurrent.futures.Future[tuple[int, str]]" = field(default_factory=concurrent.futures.Future)
    answered: bool = False  # the outcome came from the transport (which no longer reads ``delta``)
    retired: bool = False  # taken out of the queue to be applied: no aggregate is handed to the worker any more
    launched_at: float = field(default_factory=time.monotonic)  # (RoundOutcome.ready_seconds counts from here)


@dataclass
class Prepared:
    """A round's aggregate applied to copies of the shared state, ahead of ``launch + tau`` (off the training
    thread): at the apply they replace ``G, v`` (if ``base`` is still the state's ``G``) and ``target`` is merged."""

    outcome: RoundOutcome
    base: torch.Tensor  # the G it was computed from
    G: torch.Tensor
    v: torch.Tensor
    applied: torch.Tensor  # bool mask: the elements an aggregate arrived for
    target: torch.Tensor  # merge_target(G)
    blocks: list[bytes]  # block_digests(G, v): the new state's digest, taken off the training thread
    whole: bool  # every element arrived
    staged: Optional[Staged] = None  # the device path: the new G, v on the device
    ready_at: float = field(default_factory=time.monotonic)  # when it was prepared (made last: after the digests)


class Handover:
    """Hands arrived aggregates to the worker: ``prepare(outcome, G, v, copy)`` runs there, ``G, v`` (and ``copy``,
    their device copy on the device path) being the state the round is applied to."""

    def __init__(self, worker: OuterWorker,
                 prepare: Callable[[RoundOutcome, torch.Tensor, torch.Tensor, Optional[Staged]], Prepared]):
        self._worker, self._prepare = worker, prepare
        self._lock = threading.Lock()

    def on_arrival(self, pend: Pending, G: torch.Tensor, v: torch.Tensor, copy: Optional[Staged]) -> None:
        """Submits ``pend``'s aggregate as soon as it is in, from the thread that completes the round, where its
        handle takes a done callback (a ``concurrent.futures.Future``, the swarm's); otherwise the engine submits
        it at a step boundary. ``G, v, copy``: the fragment's state at launch (a state replaced meanwhile makes the
        apply compute it again)."""
        add = getattr(pend.handle, "add_done_callback", None)
        if add is None:
            return
        # The handle keeps its callbacks after they ran; a strong reference to ``pend`` here would make a cycle
        # (handle -> callback -> pend -> handle) holding the round's delta and aggregate until the cyclic GC.
        ref = weakref.ref(pend)

        def arrived(handle) -> None:
            pend = ref()
            if pend is None:  # (the round left the engine: nothing to hand over)
                return
            try:
                outcome = handle.result(timeout=0)
            except BaseException:  # (cancelled, or it raised: the training thread finds out at the apply)
                return
            self.submit(pend, outcome, G, v, copy)
        add(arrived)

    def submit(self, pend: Pending, outcome: RoundOutcome, G: torch.Tensor, v: torch.Tensor,
               copy: Optional[Staged]) -> None:
        """Hands ``outcome`` to the worker for ``pend``, once; not a round kept home (reported at ``launch + tau``,
        whenever the launch thread got to it) nor a retired one."""
        with self._lock:
            pend.answered = True
            if pend.prepared is not None or pend.retired or not RoundStatus(outcome.status).launched:
                return
            try:
                pend.prepared = self._worker.submit(self._prepare, outcome, G, v, copy)
            except RuntimeError:  # the worker is closed (the engine stopped): nothing to prepare for
                pass

    def answered(self, pend: Pending) -> None:
        """The transport's outcome of ``pend`` was read: it no longer reads the round's ``delta``."""
        with self._lock:
            pend.answered = True

    def retire(self, pend: Pending) -> Optional[concurrent.futures.Future]:
        """Takes ``pend`` out of the hand-over (it is applied, given up or forgotten); returns its prepared aggregate
        where one was submitted."""
        with self._lock:
            pend.retired = True
            return pend.prepared


class Waits:
    """The training thread's waits at a round's apply: for the transport's outcome (up to ``timeout`` s; ``stop``
    ends it; ``on_wait()`` about every 0.2 s meanwhile) and for the worker's prepared aggregate. Its fields are
    written by the training thread only: ``blocked_seconds`` (the transport's waits: compute utilization),
    ``worker_wait_seconds`` and ``waiting`` (blocked on the transport right now; the status line reads it)."""

    def __init__(self, handover: Handover, *, timeout: float, stop: threading.Event, on_wait: Callable[[], None]):
        self.handover, self.timeout, self.stop, self.on_wait = handover, timeout, stop, on_wait
        self.blocked_seconds = 0.0
        self.worker_wait_seconds = 0.0
        self.waiting = False

    def outcome(self, pend: Pending, p: int) -> RoundOutcome:
        """``pend``'s outcome (fragment ``p``), or ``missed`` once ``timeout`` passed or ``stop`` is set (the
        round is then cancelled)."""
        t0 = time.monotonic()
        self.waiting = True
        try:
            return self._until(pend, p, t0 + self.timeout)
        finally:
            self.waiting = False
            self.blocked_seconds += time.monotonic() - t0

    def _until(self, pend: Pending, p: int, deadline: float) -> RoundOutcome:
        while True:
            try:
                outcome = pend.handle.result(timeout=min(0.2, time_left(deadline)))
                self.handover.answered(pend)
                return outcome
            except TimeoutError:
                self.on_wait()
                if self.stop.is_set() or time.monotonic() >= deadline:
                    pend.handle.cancel()
                    why = "stopping" if self.stop.is_set() else f"not in within wait_timeout {self.timeout}s"
                    return RoundOutcome(p, pend.round, RoundStatus.MISSED, error=why)

    def prepared(self, in_hand: Optional[concurrent.futures.Future]) -> Optional[Prepared]:
        """The worker's prepared aggregate (None where none was handed to it), once it is done."""
        t0 = time.monotonic()
        prepared = in_hand.result() if in_hand is not None else None
        self.worker_wait_seconds += time.monotonic() - t0
        return prepared
