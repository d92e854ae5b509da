"""The launch and the apply on the parameters' device, so that the training thread only enqueues work.

The host's fp32 ``G, v`` stay the authority (digests, checkpoints, the state served to downloaders).
:class:`DeviceState` keeps a copy of every fragment's ``G, v`` on the device, or of those in flight and the next:

- launch: ``Delta = G - theta`` (+ the error-feedback residual the worker copied there: :meth:`mirror`), the eager
  jump and its write into the parameters run on the device; ``Delta`` goes to a pinned host buffer on a side
  stream, and :class:`DeferredLaunch` hands it to the transport from its own thread once the copy is done (a round
  kept home is reported at ``launch + tau``, its jump undone: the weights then differ in rounding only);
- apply: as soon as the aggregate is in, the worker runs the Nesterov step on the device copy (on a stream of its
  own) and brings the new ``G, v`` to the host (:meth:`DeviceState.advance`); at ``launch + tau`` the training
  stream waits for that work (an event, not the host) and copies ``G`` into the parameters.

Every elementwise operation rounds once (no fused multiply-add): a GPU peer's state is the one a CPU peer computes;
on the CPU every "device" tensor is the host one (the tests run this path here).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from peer.outer import host_memory
from peer.outer.offload import OuterWorker, pinned_empty, side_stream
from peer.outer.rounds import Handle, RoundOutcome, Span
from peer.outer.state import advanced, check_average

if TYPE_CHECKING:
    from peer.outer.state import NesterovSGD


@dataclass
class Staged:
    """A fragment's shared state on the device: ``G, v``, the mask of the elements an aggregate arrived for (only
    where not every one did), and the event after the work that made them (None on the CPU)."""

    host_G: torch.Tensor  # the host G these are copies of
    G: torch.Tensor
    v: torch.Tensor
    applied: Optional[torch.Tensor]
    ready: Any = None


class DeviceState:
    """Per fragment, a copy on ``device`` of the host's ``G, v``: of every fragment, or (``rolling``) only of the
    fragments with a round in flight and the next to launch, which the worker fetches ahead of its launch (both
    schedules launch fragments in the order 0, 1, ..., P - 1, 0, ...). Written by the training thread only
    (:meth:`current`, :meth:`install`, :meth:`prefetch`, :meth:`release`); :meth:`advance` and the fetches run on
    the engine's worker and return their copies instead of storing them."""

    def __init__(self, device: torch.device, n_fragments: int, numel: int, *, rolling: bool = False,
                 worker: Optional[OuterWorker] = None):
        """``numel``: the largest fragment's; ``worker``: where a rolling residency fetches (needed with it)."""
        if rolling and worker is None:
            raise ValueError("a rolling residency fetches on a worker")
        self.device, self.rolling, self._worker = device, rolling, worker
        self._copies: list[Optional[Staged]] = [None] * n_fragments
        # per fragment, the host G a fetch on the worker copies, and that fetch (rolling only)
        self._fetching: list[Optional[tuple[torch.Tensor, concurrent.futures.Future]]] = [None] * n_fragments
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # (the worker's)
        # the worker's pinned staging, allocated once (pinning memory per round costs more than the round's
        # arithmetic and holds up the training thread's CUDA calls meanwhile) and used in turn by an aggregate's
        # parts on their way in, then G and v on their way out: one vector
        self._staging = pinned_empty(numel) if self._stream is not None else None

    @classmethod
    def choose(cls, device: torch.device, numels: Sequence[int], wanted: "bool | str | None", *, eligible: bool,
               worker: OuterWorker, copies: int, reserve: int = 0, residual: bool = False) -> Optional["DeviceState"]:
        """The device copies of fragments of ``numels`` elements: ``wanted`` True keeps every fragment's, "rolling"
        those in flight (at most ``copies``: :func:`peer.outer.schedule.rolling_copies`), False none; None (auto):
        on CUDA, every fragment's where the device has twice the room they take free beyond ``reserve`` (bytes the
        training will still allocate), else the rolling residency where it has twice that room, else none.
        ``residual``: an error-feedback residual is copied there too, one fragment's at a time (:meth:`mirror`).
        ``eligible``: the engine's mode allows the device path (ValueError where it is wanted and not)."""
        if wanted is False or (wanted is None and not eligible):
            return None
        if not eligible:
            raise ValueError("the outer state on the device needs 0 <= tau < H")
        largest = max(numels, default=0)
        if wanted is None:
            if device.type != "cuda":
                return None
            free = torch.cuda.mem_get_info(device)[0] - reserve - (4 * largest if residual else 0)
            if free < 2 * cls.bytes_needed(largest * copies):
                return None
            wanted = True if free >= 2 * cls.bytes_needed(sum(numels)) else "rolling"
        return cls(device, len(numels), largest, rolling=wanted == "rolling", worker=worker)

    @staticmethod
    def bytes_needed(numel: int) -> int:
        """Device bytes the copies of ``numel`` elements of ``G, v`` take (two fp32 vectors)."""
        return 8 * numel

    def advance(self, copy: Staged, spans: Sequence[Span],
                opt: "NesterovSGD") -> tuple[Staged, torch.Tensor, torch.Tensor]:
        """(On the worker.) :func:`~peer.outer.state.advanced` on the device from ``copy`` (the state's copy
        when the aggregate came in): new device ``G, v``, not installed, and their host copies, which the caller
        makes the state. Returns the staged copies (``host_G``: the new host ``G``), the new host ``v`` and the
        host mask of the elements an aggregate arrived for."""
        if self._staging is None:  # (the CPU: the "device" copies are host tensors)
            G, v, applied = advanced(copy.G, copy.v, spans, opt)
            return Staged(G, G, v, None if bool(applied.all()) else applied), v, applied
        staging = self._staging
        with torch.cuda.stream(self._stream):
            arrived = []
            for span in spans:
                average = None
                if span.average is not None:
                    check_average(span)
                    staged_in = staging[:span.average.numel()].copy_(span.average)
                    average = staged_in.to(self.device, non_blocking=True)
                    wait_for(self._record())  # (the staging is free for the next part)
                arrived.append(Span(span.start, span.end, average))
            G, v, applied = advanced(copy.G, copy.v, arrived, opt)
            whole = bool(applied.all())
            host_G, host_v = (self._download(t) for t in (G, v))
            staged = Staged(host_G, G, v, None if whole else applied.pin_memory().to(self.device, non_blocking=True))
            staged.ready = self._record()
        return staged, host_v, applied

    def _download(self, t: torch.Tensor) -> torch.Tensor:
        """(On the worker's stream.) A host copy of the device vector ``t`` of our own, through the staging."""
        assert self._staging is not None
        out = self._staging[:t.numel()]
        out.copy_(t, non_blocking=True)
        wait_for(self._record())
        # (the state outlives the staging; in huge pages, so that its free, on the worker under the GIL, takes
        # 1.6 ms for a 1B fragment's 636 MB where 4 KiB pages took 15-30 ms of every Python thread's time)
        return host_memory.empty(t.numel(), t.dtype).copy_(out)

    def prefetch(self, p: int, G: torch.Tensor, v: torch.Tensor) -> None:
        """(Rolling only.) Starts fetching fragment ``p``'s copy of the host state ``G, v`` on the worker, unless it
        is on the device or on its way already: :meth:`current` takes it at the launch. Must be called on the
        training thread, ahead of ``p``'s launch."""
        fetching = self._fetching[p]
        if not self.rolling or self._holds(p, G) or (fetching is not None and fetching[0] is G):
            return
        assert self._worker is not None
        self._fetching[p] = (G, self._worker.submit(self._fetch, G, v))

    def release(self, p: int) -> None:
        """(Rolling only.) Drops fragment ``p``'s copy: no round of it is in flight and it is not the next to
        launch. Must be called on the training thread."""
        if self.rolling:
            self._copies[p] = self._fetching[p] = None

    def resident(self) -> int:
        """Fragments whose copy is on the device, or on its way there."""
        return sum(copy is not None or fetching is not None for copy, fetching in zip(self._copies, self._fetching))

    def _holds(self, p: int, G: torch.Tensor) -> bool:
        copy = self._copies[p]
        return copy is not None and copy.host_G is G

    def _fetch(self, G: torch.Tensor, v: torch.Tensor) -> Staged:
        """(On the worker.) Copies of ``G, v`` through the staging, so the training thread neither pins nor
        copies host memory for them."""
        return self._copies_of(G, v, self._through_staging)

    def _through_staging(self, host: torch.Tensor) -> torch.Tensor:
        """(On the worker's stream.) ``host`` on the device, copied through the pinned staging."""
        if self._staging is None:
            return host.to(self.device)
        staged = self._staging[:host.numel()].copy_(host)
        on_device = staged.to(self.device, non_blocking=True)
        wait_for(self._record())  # (the staging is free again)
        return on_device

    def mirror(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(On the worker.) A copy on the device of the host vector ``host`` (an error-feedback residual, for the
        next launch), through the staging, and the event after the copy (on the CPU: ``host`` itself, None)."""
        if self._stream is None:
            return host.to(self.device), None
        with self._on_stream():
            return self._through_staging(host), self._record()

    def upload(self, G: torch.Tensor, v: torch.Tensor) -> Staged:
        """Copies of the host state ``G, v``, on their way (:meth:`install` orders the training stream after)."""
        return self._copies_of(G, v, self._to_device)

    def _copies_of(self, G: torch.Tensor, v: torch.Tensor, to_device: Callable[[torch.Tensor], torch.Tensor]) -> Staged:
        """``G, v`` copied by ``to_device`` on the worker's stream, with the event after the copies."""
        with self._on_stream():
            staged = Staged(G, to_device(G), to_device(v), None)
            staged.ready = self._record()
        return staged

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """(On the worker's stream.) Pinned first, so the copy neither blocks the host nor counts as a sync."""
        if self._stream is None:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def install(self, p: int, staged: Staged) -> Staged:
        """Makes ``staged`` fragment ``p``'s copy; the work enqueued after this call on the current stream runs
        after the work that made it. Must be called on the training thread when ``staged.host_G`` becomes the
        state's ``G``."""
        if staged.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(staged.ready)
            for t in (staged.G, staged.v, staged.applied):
                if t is not None:
                    t.record_stream(stream)  # (allocated on the worker's stream, read on this one)
        self._copies[p] = staged
        return staged

    def current(self, p: int, G: torch.Tensor, v: torch.Tensor) -> Staged:
        """Fragment ``p``'s copy of the host state ``G, v``: the one installed, or fetched ahead (waited for), or
        uploaded now where the state changed without either (the start, an adoption, a checkpoint load, a fetch
        that failed). Must be called on the training thread."""
        copy = self._copies[p]
        if copy is not None and copy.host_G is G:
            return copy
        fetching, self._fetching[p] = self._fetching[p], None
        fetched = None
        if fetching is not None and fetching[0] is G:
            with contextlib.suppress(concurrent.futures.CancelledError, RuntimeError):  # (then uploaded below)
                fetched = fetching[1].result()
        return self.install(p, fetched if fetched is not None else self.upload(G, v))

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _record(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


POLL_S = 0.0005  # wait_for's first pause between two questions to an event; each pause doubles, up to
POLL_MAX_S = 0.004  # this: every wake-up takes the GIL, and a thread that wakes every 0.5 ms cost a host-bound
# training thread 9% of its op rate while it waited (docs/benchmarks.md, 2026-11-28); a copy done late by at most
# 4 ms delays a round's hand-off by that much


def wait_for(event: Optional[Any]) -> None:
    """Waits (polling) until the CUDA ``event`` is done (None: at once). Polled rather than synchronized: a
    synchronize can hold a core spinning, and counts as a sync in CUDA's sync debug mode (a test checks there is
    none on the training thread, while this runs on others)."""
    pause = POLL_S
    while event is not None and not event.query():
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)


def to_host(delta: torch.Tensor, out: torch.Tensor) -> Optional[Any]:
    """Starts copying ``delta`` into the host vector ``out`` (pinned on CUDA) on a side stream, after the work
    enqueued so far; returns the event that marks the copy done (None: done already, on the CPU)."""
    if delta.device.type != "cuda":
        out.copy_(delta)
        return None
    computed = torch.cuda.Event()
    computed.record()
    side = side_stream(delta.device)
    with torch.cuda.stream(side):
        side.wait_event(computed)
        out.copy_(delta, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    delta.record_stream(side)
    return copied


class DeferredLaunch:
    """A round whose transport launch runs on a thread of its own once its ``Delta`` is on the host: a
    :class:`~peer.outer.rounds.Handle` for the engine. ``cancel`` reaches the transport's handle whenever it
    comes."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, copied: Optional[Any],
                 launch: Callable[[], Handle]):
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: list[Callable[["DeferredLaunch"], None]] = []
        self._handle: Optional[Handle] = None  # the transport's, once launched
        self._launched: concurrent.futures.Future = pool.submit(self._run, copied, launch)

    def _run(self, copied: Optional[Any], launch: Callable[[], Handle]) -> Handle:
        wait_for(copied)
        handle = launch()
        with self._lock:
            if self._cancelled:
                handle.cancel()
            self._handle, callbacks = handle, list(self._callbacks)
        for fn in callbacks:
            self._forward(handle, fn)
        return handle

    def add_done_callback(self, fn: Callable[["DeferredLaunch"], None]) -> None:
        """Calls ``fn(self)`` once the transport's outcome is in, where the transport's handle can say so (a
        ``concurrent.futures.Future``); otherwise never (the engine then finds the outcome at a step boundary)."""
        with self._lock:
            handle = self._handle
            if handle is None:
                self._callbacks.append(fn)
                return
        self._forward(handle, fn)

    def _forward(self, handle: Handle, fn: Callable[["DeferredLaunch"], None]) -> None:
        add = getattr(handle, "add_done_callback", None)
        if add is None:
            return
        # (weak: the handle keeps its callbacks, and self keeps the handle; a cycle would hold the round's
        # aggregate until the cyclic GC)
        ref = weakref.ref(self)

        def forward(_) -> None:
            launch = ref()
            if launch is not None:
                fn(launch)
        add(forward)

    def launched(self, timeout: Optional[float] = None) -> bool:
        """Whether the transport was handed the round (or the launch ended otherwise) within ``timeout``."""
        return concurrent.futures.wait([self._launched], timeout).not_done == set()

    def done(self) -> bool:
        handle = self._handle  # (set before the launch's callbacks run, which may ask)
        if handle is not None:
            return handle.done()
        f = self._launched
        return f.done() and (f.cancelled() or f.exception() is not None)  # (the launch raised, or never ran)

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        """The transport's outcome; raises ``TimeoutError`` if it is not in within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = self._handle
        if handle is None:
            handle = self._launched.result(timeout)  # (concurrent.futures.TimeoutError is TimeoutError)
        return handle.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def cancel(self) -> bool:
        with self._lock:
            self._cancelled = True
        if self._launched.cancel():
            return True
        handle = self._handle
        return handle.cancel() if handle is not None else False
