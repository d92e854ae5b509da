"""Fresh host vectors for data written once right after allocation: a decoded average, a received part, a new
``G, v``, a pooled launch buffer.

Such a vector's first touch is a page fault per 4 KiB, which for a span of 64 MB costs about as much as the decode
that fills it (23 of 38 ms on one core). :func:`empty` asks the kernel for 2 MiB pages on that vector's range only
(``madvise(MADV_HUGEPAGE)``, honoured where transparent huge pages are ``madvise`` or ``always``): a policy for
these buffers, not for the whole process (torch's ``THP_MEM_ALLOC_ENABLE`` would cover every large tensor). The
advice is best effort: where it is refused or unknown (not Linux), the vector is an ordinary one. Then the
allocating thread touches each page once, so that threads writing it later do not fault pages of one mapping at
the same time (they contend in the kernel, several times slower than one thread). :func:`registered` gives such a
vector to a pinning function (CUDA's host registration: ``peer/outer/offload.py``) for its lifetime.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Callable, Optional

import numpy as np
import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE  # smaller vectors rarely hold a whole aligned huge page

_madvise: Optional[Callable[[int, int, int], int]] = None
if sys.platform.startswith("linux"):
    try:
        _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
        _libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_madvise.restype = ctypes.c_int
        _madvise = _libc_madvise
    except (OSError, AttributeError):
        _madvise = None


def advise_huge(address: int, nbytes: int) -> bool:
    """Asks for huge pages on the whole 4 KiB pages of ``[address, address + nbytes)``, which must not have been
    touched yet to benefit. Returns whether the kernel took the advice (False for small ranges, never raises)."""
    start, end = (address + 4095) & ~4095, (address + nbytes) & ~4095
    if _madvise is None or nbytes < MIN_BYTES or end <= start:
        return False
    return _madvise(start, end - start, MADV_HUGEPAGE) == 0


def empty_array(n: int, dtype) -> np.ndarray:
    """A new numpy array of ``n`` elements (contents undefined), advised as above and first touched here."""
    a = np.empty(n, dtype)
    advise_huge(a.ctypes.data, a.nbytes)
    a.view(np.uint8)[::4096] = 0
    return a


def empty(n: int, dtype: torch.dtype = torch.float32, *, touch: bool = True) -> torch.Tensor:
    """A new CPU tensor of ``n`` elements (contents undefined), advised as above and first touched here unless not
    ``touch`` (a destination one thread fills in order as its pieces arrive: memory is committed as they come)."""
    t = torch.empty(n, dtype=dtype)
    advise_huge(t.data_ptr(), t.numel() * t.element_size())
    if touch and t.numel():
        t.view(torch.uint8)[::4096] = 0
    return t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`empty` of ``t``'s size and dtype for a contiguous CPU ``t`` (a flat vector), else ``torch.empty_like``."""
    if t.device.type != "cpu" or t.dim() != 1:
        return torch.empty_like(t)
    return empty(t.numel(), t.dtype)


def registered(n: int, register: Callable[[int, int], bool],
               unregister: Callable[[int], None]) -> Optional[torch.Tensor]:
    """A new fp32 vector of ``n`` elements (as :func:`empty_array`) that ``register(address, nbytes)`` accepted, or
    None where it refused. ``unregister(address)`` runs once, when the last tensor on the vector's memory is gone and
    before that memory is freed (the tensors keep the array that owns it alive)."""
    a = empty_array(n, np.float32)
    if not register(a.ctypes.data, a.nbytes):
        return None
    weakref.finalize(a, unregister, a.ctypes.data)
    return torch.from_numpy(a)
