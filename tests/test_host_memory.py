"""Fresh host vectors (peer/outer/host_memory.py): ordinary tensors, with huge pages where the kernel offers them;
pinned vectors at their size (peer/outer/offload.py)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.outer import host_memory
from peer.outer.offload import pinned_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode (the bracketed word), or "" where there is none."""
    try:
        text = THP.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def vm_flags_at(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` ("hg": huge pages advised)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.parametrize("touch", [True, False])
@pytest.mark.parametrize("n", [0, 1, 1000, 3 << 20])
def test_empty_is_an_ordinary_writable_tensor(n, touch):
    t = host_memory.empty(n, touch=touch)
    assert t.shape == (n,) and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    a = host_memory.empty_array(n, np.uint16)
    assert a.shape == (n,) and a.dtype == np.uint16 and a.flags.writeable
    like = host_memory.empty_like(torch.zeros(n, dtype=torch.float64))
    assert like.shape == (n,) and like.dtype == torch.float64


def test_small_ranges_are_not_advised():
    t = torch.empty(1000)
    assert not host_memory.advise_huge(t.data_ptr(), 4000)
    assert not host_memory.advise_huge(t.data_ptr(), 0)


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always"),
                    reason="no transparent huge pages on this kernel")
def test_a_large_vector_is_advised_huge_pages_and_an_ordinary_one_is_not():
    # (whether the kernel then finds free huge pages at the first touch depends on the machine's state: the
    # advice is what this module controls)
    t = host_memory.empty(16 << 20, touch=False)  # 64 MiB
    assert "hg" in vm_flags_at(t.data_ptr() + t.numel() * 2)
    plain = torch.empty(16 << 20)
    assert "hg" not in vm_flags_at(plain.data_ptr() + plain.numel() * 2)


def test_a_registered_vector_is_unregistered_once_after_its_last_view_and_a_refusal_gives_none():
    """The lifetime the CUDA registration relies on: unregister runs when no tensor on the memory is left, not when
    the first one goes (a pool hands out slices of its vectors), and exactly once."""
    calls: list[tuple] = []

    def register(address: int, nbytes: int) -> bool:
        calls.append(("register", address, nbytes))
        return True

    t = host_memory.registered(1000, register, lambda address: calls.append(("unregister", address)))
    assert t is not None and t.shape == (1000,) and t.dtype == torch.float32 and t.device.type == "cpu"
    address = t.data_ptr()
    assert calls == [("register", address, 4000)]
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(2.0)  # (still ours to write)
    assert calls == [("register", address, 4000)]
    del view
    gc.collect()
    assert calls == [("register", address, 4000), ("unregister", address)]
    refused: list[int] = []
    assert host_memory.registered(1000, lambda a, n: False, refused.append) is None
    gc.collect()
    assert refused == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
def test_cuda_a_pinned_vector_takes_its_size_not_the_next_power_of_two():
    """A pinned vector of 100M + 1 floats (400 MB) is registered host memory of its size, not a block of torch's
    pinned allocator (rounded to 512 MiB); copies from and to it do not wait, and dropping it unregisters it."""
    def counters() -> dict:
        return {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k and "current" in k}

    before = counters()
    vector = pinned_empty(100_000_001)
    assert vector.is_pinned() and vector.numel() == 100_000_001
    assert counters() == before  # (none of torch's blocks)
    vector.copy_(torch.arange(100_000_001, dtype=torch.float32))
    back = pinned_empty(100_000_001)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_device = vector.to("cuda", non_blocking=True)
        back.copy_(on_device, non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(back, vector)
    del vector, back, on_device
    gc.collect()
    again = pinned_empty(100_000_001)  # (where it reuses a range still registered, registering fails: torch's block)
    assert again.is_pinned() and counters() == before
