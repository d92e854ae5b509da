"""Moving the outer engine's work off the training thread: a worker thread for the host math, and the transfers
between a fragment's parameters (on their device) and the host's fp32 outer state.

The outer state (``G, v, E, u``) lives on the host in fp32, the parameters on the training device. On the CPU every
transfer below is a plain copy (or none), bit for bit the synchronous engine's. On CUDA:

- :func:`snapshot` gathers the fragment on the device (in stream order before any later update of the
  parameters) and copies it to a pinned host buffer on a side stream; :meth:`Snapshot.wait` waits for that copy.
- :func:`to_device` stages a host vector in pinned memory and copies it without blocking the host.
- :func:`gather` / :func:`scatter` read and write the parameters as one flat fp32 vector on their own device, so
  a merge is computed where the parameters are.

:class:`HostBuffers` keeps the launch's fragment-sized host vectors between rounds: a fresh one costs page faults
(or a new pinned allocation) that outweigh its arithmetic.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Callable, Optional

import torch

from peer.outer import cpu_fused, host_memory
from peer.outer.fragments import Fragment

log = logging.getLogger(__name__)


# Pinned vectors of this size and more are host_memory's, registered with CUDA: torch's pinned allocator rounds every
# block up to a power of two to reuse it for others (a 1B fragment's 636 MB vector took 1 GiB), and torch 2.11 takes
# no setting that stops it.
PINNED_ROUND_MB = 64


def pinned_empty(numel: int) -> torch.Tensor:
    """A pinned fp32 host vector of ``numel`` elements; CUDA only. From :data:`PINNED_ROUND_MB` up it holds exactly its
    size, in huge pages (``host_memory.registered``), else torch's pinned allocator's block. Torch does not track
    copies from or to a registered vector: it must outlive those enqueued (the pools wait for their events before
    reusing one), and dropping it synchronizes the device before its memory is unregistered and freed."""
    if numel * 4 >= PINNED_ROUND_MB << 20:
        vector = host_memory.registered(numel, _cuda_register, _cuda_unregister)
        if vector is not None:
            return vector
    return torch.empty(numel, dtype=torch.float32, pin_memory=True)


def _cuda_register(address: int, nbytes: int) -> bool:
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        log.info("pinning %d bytes by registration failed (%s): torch's pinned allocator instead", nbytes, err)
        return False
    return True


def _cuda_unregister(address: int) -> None:
    try:
        torch.cuda.synchronize()  # (no copy enqueued from or to it may still run)
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception as e:  # (a finalizer: at exit CUDA may be gone already)
        log.debug("unregistering pinned memory at %#x failed: %s", address, e)


class OuterWorker:
    """One thread for the engine's host math (an aggregate's Nesterov update, the codec's error-feedback
    round trip). Tasks run one at a time in submission order. Owned by the engine: :meth:`close` stops it."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-worker")

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)

    def release(self, box: list) -> None:
        """Empties ``box`` on the worker thread, so that what it alone still holds is freed there: freeing a 1B
        model's fragment (640 MB of host memory) costs its thread about 20 ms of unmapping. The caller must have
        dropped its other references to the objects in ``box`` (a closed worker empties it here)."""
        try:
            self._pool.submit(box.clear)
        except RuntimeError:  # (shut down)
            box.clear()

    def close(self) -> None:
        """Waits for the task running now, drops the queued ones and ends the thread (idempotent)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class HostBuffers:
    """fp32 host vectors of up to ``numel`` elements, handed out by :meth:`take` and taken back by :meth:`give`
    for the next :meth:`take` (at most ``keep`` are kept; pinned where ``pinned``). One writer: the thread that
    launches rounds. The contract is the giver's: a vector is given back only once nothing reads or writes it
    any more (not the transport, not the worker, not a checkpoint's copy), except copies to the device already
    enqueued where ``device_reads`` (then :meth:`take` waits for those)."""

    def __init__(self, numel: int, *, pinned: bool = False, keep: int = 4, device_reads: Optional[bool] = None):
        self.numel, self.pinned, self.keep = numel, pinned, keep
        self.device_reads = pinned if device_reads is None else device_reads
        self._free: list[tuple[torch.Tensor, Any]] = []  # (buffer, the CUDA event after its last use, or None)
        self._ours: dict[int, torch.Tensor] = {}  # data_ptr -> a whole buffer handed out by take
        self.allocated = 0  # buffers allocated since start (the rest were reused)

    def take(self, numel: int) -> torch.Tensor:
        """A vector of ``numel`` elements (contents undefined)."""
        if numel > self.numel:
            raise ValueError(f"a buffer of {numel} elements asked of a pool of {self.numel}")
        if self._free:
            whole, used = self._free.pop()
            if used is not None:  # a copy to the device enqueued before it was given back may still read it
                used.synchronize()
        else:
            whole = pinned_empty(self.numel) if self.pinned else host_memory.empty(self.numel)
            self.allocated += 1
        self._ours[whole.data_ptr()] = whole
        return whole[:numel]

    def give(self, *vectors: Optional[torch.Tensor]) -> None:
        """Takes back vectors handed out by :meth:`take` (anything else, and None, is ignored). Where
        ``device_reads``, copies from them already enqueued on the current stream may still run: :meth:`take` waits
        for those."""
        for vector in vectors:
            whole = None if vector is None else self._ours.pop(vector.data_ptr(), None)
            if whole is None or len(self._free) >= self.keep:
                continue
            used = None
            if self.device_reads:
                used = torch.cuda.Event()
                used.record()
            self._free.append((whole, used))


def device_of(frag: Fragment) -> torch.device:
    return frag.params[0].device if frag.params else torch.device("cpu")


def gather(frag: Fragment) -> torch.Tensor:
    """The fragment's current values as a new flat fp32 vector on the parameters' device (the CPU: ``flat()``)."""
    if device_of(frag).type != "cuda":
        return frag.flat()
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in frag.params])


def difference(frag: Fragment, S: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``S - theta`` into ``out``, ``theta`` the fragment's current values read where they are (parameters on the
    CPU: no copy of them first), ``S`` and ``out`` fp32 on the parameters' device: the bits of ``torch.sub(S,
    gather(frag))``; on the CPU one fused pass (:func:`peer.outer.cpu_fused.difference`)."""
    if cpu_fused.difference(frag.params, S, out):
        return out
    offset = 0
    for p in frag.params:
        k = p.numel()
        torch.sub(S[offset:offset + k], p.detach().reshape(-1), out=out[offset:offset + k])
        offset += k
    return out


def scatter(frag: Fragment, flat: torch.Tensor) -> None:
    """Writes ``flat`` (fp32, on the parameters' device or the host) into the parameters; a host vector goes
    through :func:`to_device` first, so the host does not wait for the device queue. On the CPU one fused pass
    (:func:`peer.outer.cpu_fused.assign`)."""
    if cpu_fused.assign(frag.params, flat):
        return
    frag.assign(to_device(flat, device_of(frag)))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: itself where it is there already; on CUDA a non-blocking copy from pinned memory."""
    if host.device == device or device.type != "cuda":
        return host
    staged = host if host.is_pinned() else host.pin_memory()
    return staged.to(device, non_blocking=True)


class Snapshot:
    """A fragment's values at the moment :func:`snapshot` was called, on their way to the host."""

    def __init__(self, host: torch.Tensor, done: Optional[Any] = None, keep: Optional[torch.Tensor] = None):
        self._host, self._done, self._keep = host, done, keep

    def wait(self) -> torch.Tensor:
        """The fp32 host vector (waits for its copy only)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = self._keep = None
        return self._host


def snapshot(frag: Fragment, out: Optional[torch.Tensor] = None) -> Snapshot:
    """Starts copying the fragment's current values to the host (CPU: done at once), into ``out`` where given
    (fp32, ``frag.numel`` elements; pinned on CUDA). Must be called on the training thread at the step boundary
    whose values are wanted: later updates are ordered after the gather."""
    device = device_of(frag)
    if device.type != "cuda":
        return Snapshot(frag.flat(out=out))
    on_device = gather(frag)
    gathered = torch.cuda.Event()
    gathered.record()
    side = side_stream(device)
    host = out if out is not None else pinned_empty(on_device.numel())
    with torch.cuda.stream(side):
        side.wait_event(gathered)
        host.copy_(on_device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    on_device.record_stream(side)  # its memory is not reused before the side stream's copy ran
    return Snapshot(host, done, on_device)


_SIDE_STREAMS: dict[torch.device, Any] = {}


def side_stream(device: torch.device):
    """One copy stream per device, created on first use (from the training thread only)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
