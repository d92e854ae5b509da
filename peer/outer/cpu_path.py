"""The codecs' CPU path: fused numba kernels (``peer/outer/cpu_kernels.py``) instead of multi-pass torch ops.

Contract: for a CPU input each function gives exactly the torch path's result (message bytes, tensor bits,
errors raised); it returns ``None`` where it does not apply (no numba, a big-endian host, an input it leaves to
torch), and the codec then runs its torch path. Decoders get sizes already checked by ``wire._read``.

Threads: kernels release the GIL and run over ranges of blocks, split between the calling thread and a small pool
(``torch.get_num_threads() - 1`` workers), so concurrent calls from several threads are safe, and a call never
waits for another call's chunks. The kernels compile once per process, on first use, under a lock that ``fork``
also takes, so a child never inherits a half-done compile; the child drops the parent's pool and makes its own.
Set ``SWARMLOCO_NO_NUMBA=1`` to use the torch path everywhere.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Callable, Optional

import numpy as np
import torch

from peer.outer.host_memory import empty_array
from peer.outer.wire import CodecError, _nonfinite_error

log = logging.getLogger(__name__)

_MIN_PART = 1 << 18  # elements per thread below which one thread does it all (a hand-off costs tens of µs)
_lock = threading.Lock()
_kernels: Optional[ModuleType] = None
_failed = False
_pool: Optional[ThreadPoolExecutor] = None
_pool_workers = 0


def _after_fork_in_child() -> None:
    global _lock, _pool, _pool_workers
    _lock = threading.Lock()
    _pool, _pool_workers = None, 0  # the parent's workers do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _lock.acquire(), after_in_parent=lambda: _lock.release(),
                        after_in_child=_after_fork_in_child)


def kernels() -> Optional[ModuleType]:
    """The compiled kernels, or None (torch path): compiled on first use, once per process."""
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels
    with _lock:
        if _kernels is None and not _failed:
            if os.environ.get("SWARMLOCO_NO_NUMBA") == "1" or sys.byteorder != "little":
                _failed = True
                return None
            try:
                from peer.outer import cpu_kernels
                _warm_up(cpu_kernels)
                _kernels = cpu_kernels
            except Exception as e:  # no numba, or it cannot compile here: the torch path still works
                _failed = True
                log.warning("codec: numba kernels unavailable (%s: %s); using the slower torch path",
                            type(e).__name__, e)
    return _kernels


def _warm_up(K: ModuleType) -> None:
    """Compiles every kernel for the argument types the functions below pass (read-only wire buffers
    included: numba types them apart), so no call compiles later, on any thread."""
    x = np.zeros(64, np.float32)
    xi = x.view(np.int32)
    ro_u8, ro_f32, ro_u16 = (np.frombuffer(bytes(64 * t.itemsize), t) for t in (np.dtype(np.uint8),
                             np.dtype(np.float32), np.dtype(np.uint16)))
    u8, f32, u16 = np.zeros(64, np.uint8), np.zeros(64, np.float32), np.zeros(64, np.uint16)
    K.e3m0_encode(xi, 64, 0, 1, u8, f32)
    K.e3m0_decode(ro_u8, ro_f32, f32, 64, 0, 1)
    K.fp8_encode(x, xi, 64, 0, 1, u8, f32)
    K.fp8_decode(ro_u8, ro_f32, f32, 64, 0, 1)
    K.bf16_encode(xi, 0, 64, u16)
    K.bf16_decode(ro_u16, f32.view(np.int32), 0, 64)
    K.topk_encode(xi, 64, 32, 0, 1, u16, f32, u8)
    K.topk_check(ro_u16, 64, 32)
    K.topk_decode(ro_u16, ro_f32, f32, 64, 32, 0, 1)
    f32s = [np.zeros(64, np.float32) for _ in range(5)]
    thetas, offsets = param_list([np.zeros(32, np.float32), np.zeros(32, np.float32)])
    for held in ("", "_held"):
        getattr(K, "nesterov" + held)(*f32s, np.float32(0.9), np.float32(0.7), 0, 64)
        getattr(K, "eager_jump" + held)(thetas, offsets, *f32s[:4], np.float32(0.9), np.float32(-0.7), 0, 64)
        getattr(K, "difference" + held)(thetas, offsets, *f32s[:2], 0, 64)
        getattr(K, "assign" + held)(thetas, offsets, f32s[0], 0, 64)


def param_list(arrays: list[np.ndarray]) -> tuple[object, np.ndarray]:
    """The kernels' form of a fragment's parameters (``cpu_kernels``: the list and its offsets)."""
    from numba.typed import List

    thetas = List()
    for a in arrays:
        thetas.append(a)
    return thetas, np.cumsum([0] + [a.size for a in arrays], dtype=np.int64)


def parallel(fn: Callable[[int, int], int], n_blocks: int, block_elems: int) -> int:
    """Runs fn(b0, b1) over [0, n_blocks) on up to torch.get_num_threads() threads; ORs their flags. The range
    is cut in small chunks that each thread takes in turn: a thread the OS runs less (beside torch's own
    OpenMP workers, which spin a while after each op) then takes fewer, never holding up the rest."""
    global _pool, _pool_workers
    workers = min(max(1, torch.get_num_threads()), max(1, n_blocks * block_elems // _MIN_PART))
    if workers <= 1:
        return fn(0, n_blocks)
    with _lock:
        if _pool is None or _pool_workers < workers - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_workers = ThreadPoolExecutor(workers - 1, thread_name_prefix="codec"), workers - 1
        pool = _pool
    n_chunks = min(n_blocks, 8 * workers)
    bounds = [n_blocks * i // n_chunks for i in range(n_chunks + 1)]
    chunks = iter(range(n_chunks))
    take = threading.Lock()

    def drain() -> int:
        flag = 0
        while True:
            with take:
                i = next(chunks, None)
            if i is None:
                return flag
            flag |= fn(bounds[i], bounds[i + 1])

    futures = [pool.submit(drain) for _ in range(workers - 1)]
    flag = drain()
    for f in futures:  # one still queued behind another call's never took a chunk: drop it, do not wait
        if not f.cancel():
            flag |= f.result()
    return flag


def each(fn: Callable[[int], None], count: int) -> None:
    """Runs fn(i) for every i in [0, count) on up to torch.get_num_threads() threads, whole items per thread (the
    pieces of a span: each small enough for one thread)."""
    def run(i0: int, i1: int) -> int:
        for i in range(i0, i1):
            fn(i)
        return 0
    parallel(run, count, _MIN_PART)


def _check_flag(flag: int, name: str) -> int:
    """A kernel's flag; 2 means its arrays did not fit the range (the sizes computed before rule it out)."""
    if flag & 2:
        raise CodecError(f"{name} piece: sizes do not match")
    return flag


def _f32_host(flat: torch.Tensor, exact_only: bool = False) -> Optional[np.ndarray]:
    """The input as a contiguous float32 numpy array (shared when possible), or None if not on the CPU.
    exact_only: only dtypes that convert to float32 exactly (bf16 rounds once, from the input's own value)."""
    if flat.device.type != "cpu" or (exact_only and flat.dtype == torch.float64):
        return None
    return flat.detach().to(torch.float32).contiguous().numpy()


# ------------------------------------------------------------------------------------------ dense


def _encode_blocks(flat: torch.Tensor, block_bytes: int, name: str, run) -> Optional[tuple[bytes, bytes]]:
    """A block codec's encode (blocks of 64 values, ``block_bytes`` of data and a float32 scale each):
    ``run(K, x, xi, n, b0, b1, data, scales)`` encodes blocks [b0, b1) with kernel module ``K``."""
    K = kernels()
    x = _f32_host(flat) if K is not None else None
    if K is None or x is None:
        return None
    n, xi = x.size, x.view(np.int32)
    nb = -(-n // 64)
    data, scales = empty_array(nb * block_bytes, np.uint8), empty_array(nb, np.float32)
    if _check_flag(parallel(lambda b0, b1: run(K, x, xi, n, b0, b1, data, scales), nb, 64), name):
        raise _nonfinite_error()
    return data.tobytes(), scales.tobytes()


def _dest(n: int, out: Optional[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """A decoder's destination: ``out`` (checked by the codec: contiguous float32 on the CPU, ``n`` elements) or a
    new tensor, with its numpy view for the kernels."""
    if out is None:
        a = empty_array(n, np.float32)
        return torch.from_numpy(a), a
    return out, out.numpy()


def _decode_blocks(data: bytes, scales: bytes, n: int, name: str, run,
                   out: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, int]]:
    """A block codec's decode into ``out`` (or a new float32 tensor), and the kernels' flags ORed (sizes already
    checked): ``run(K, d, s, o, n, b0, b1)`` decodes blocks [b0, b1)."""
    K = kernels()
    if K is None:
        return None
    (t, o), d, s = _dest(n, out), np.frombuffer(data, np.uint8), np.frombuffer(scales, np.float32)
    flag = _check_flag(parallel(lambda b0, b1: run(K, d, s, o, n, b0, b1), s.size, 64), name)
    return t, flag


def e3m0_encode(flat: torch.Tensor) -> Optional[tuple[bytes, bytes]]:
    return _encode_blocks(flat, 32, "e3m0", lambda K, x, xi, n, b0, b1, d, s: K.e3m0_encode(xi, n, b0, b1, d, s))


def e3m0_decode(data: bytes, scales: bytes, n: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    got = _decode_blocks(data, scales, n, "e3m0", lambda K, d, s, o, n, b0, b1: K.e3m0_decode(d, s, o, n, b0, b1), out)
    return None if got is None else got[0]


def fp8_encode(flat: torch.Tensor) -> Optional[tuple[bytes, bytes]]:
    return _encode_blocks(flat, 64, "fp8", lambda K, x, xi, n, b0, b1, d, s: K.fp8_encode(x, xi, n, b0, b1, d, s))


def fp8_decode(data: bytes, scales: bytes, n: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Raises CodecError on a NaN code."""
    got = _decode_blocks(data, scales, n, "fp8", lambda K, d, s, o, n, b0, b1: K.fp8_decode(d, s, o, n, b0, b1), out)
    if got is not None and got[1]:
        raise CodecError("fp8 piece has NaN codes (0x7F or 0xFF)")
    return None if got is None else got[0]


def bf16_encode(flat: torch.Tensor) -> Optional[bytes]:
    K = kernels()
    x = _f32_host(flat, exact_only=True) if K is not None else None
    if K is None or x is None:
        return None
    n, xi = x.size, x.view(np.int32)
    out = empty_array(n, np.uint16)
    if _check_flag(parallel(lambda i0, i1: K.bf16_encode(xi, i0, i1, out), n, 1), "bf16"):
        raise _nonfinite_error()
    return out.tobytes()


def bf16_decode(data: bytes, n: int, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    K = kernels()
    if K is None:
        return None
    (t, o), bits = _dest(n, out), np.frombuffer(data, np.uint16)
    oi = o.view(np.int32)
    if _check_flag(parallel(lambda i0, i1: K.bf16_decode(bits, oi, i0, i1), n, 1), "bf16"):
        raise CodecError("bf16 piece has non-finite values")
    return t


# ------------------------------------------------------------------------------------------ top-k


def topk_encode(flat: torch.Tensor, k: int, count: int,
                fallback: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
                ) -> Optional[tuple[bytes, bytes]]:
    """``fallback(rows, n_last)``: the torch path's (entries, scales) for whole blocks ``rows`` (the last of
    them with n_last real elements), for blocks where ties make torch.topk's own choice count."""
    K = kernels()
    x = _f32_host(flat) if K is not None else None
    if K is None or x is None:
        return None
    n = x.size
    nb = -(-n // 4096)
    entries, scales, amb = empty_array(count, np.uint16), empty_array(nb, np.float32), np.zeros(nb, np.uint8)
    xi = x.view(np.int32)
    if _check_flag(parallel(lambda b0, b1: K.topk_encode(xi, n, k, b0, b1, entries, scales, amb), nb, 4096),
                   f"topk{k}"):
        raise _nonfinite_error()
    tied = np.flatnonzero(amb)
    if tied.size:
        rows = torch.zeros(tied.size, 4096, dtype=torch.float32)
        xt = torch.from_numpy(x)
        for r, b in enumerate(tied.tolist()):
            rows[r, :min(4096, n - 4096 * b)] = xt[4096 * b:4096 * (b + 1)]
        e, s = fallback(rows, min(4096, n - 4096 * int(tied[-1])))
        for r, b in enumerate(tied.tolist()):  # a tied block has more than k elements: k entries
            entries[b * k:b * k + k] = e[r].numpy().astype(np.uint16)
        scales[tied] = s.numpy()
    return entries.tobytes(), scales.tobytes()


def topk_decode(data: bytes, scales: bytes, n: int, k: int, name: str,
                out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Checks every block's indices (rising strictly, inside the block), then decodes."""
    K = kernels()
    if K is None:
        return None
    e, s = np.frombuffer(data, np.uint16), np.frombuffer(scales, np.float32)
    bad = K.topk_check(e, n, k)
    if bad == 1:
        raise CodecError(f"{name} piece has a block whose indices do not rise strictly")
    if bad:
        raise CodecError(f"{name} piece has an index past its block's end")
    t, o = _dest(n, out)
    _check_flag(parallel(lambda b0, b1: K.topk_decode(e, s, o, n, k, b0, b1), s.size, 4096), name)
    return t
