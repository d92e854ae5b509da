"""Fresh host vectors (peer/outer/host_memory.py): ordinary tensors, with huge pages where the kernel offers them;
pinned vectors at their size (peer/outer/offload.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.outer import host_memory
from peer.outer.offload import allocator_setting, exact_pinned_sizes, pinned_empty

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


def test_the_exact_pinned_setting_keeps_the_process_own_allocator_settings():
    """torch resets the allocator settings a new setting string leaves out, so ours goes after the process's own
    (both environment names), and not at all where the process names the key itself."""
    extra = "pinned_max_round_threshold_mb:64"
    assert allocator_setting({}, extra) == extra
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, extra) == \
        "expandable_segments:True," + extra
    both = {"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}
    assert allocator_setting(both, extra) == "a:1,b:2," + extra
    own = "pinned_max_round_threshold_mb:8"
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": own}, extra) == own
    assert exact_pinned_sizes()  # (this torch knows the setting)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
def test_cuda_a_pinned_vector_takes_its_size_not_the_next_power_of_two():
    """A pinned vector of 100M + 1 floats (400 MB) holds about its size of pinned memory, where torch's rounding
    would take 512 MiB."""
    def counters() -> dict:
        return {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k and "current" in k}

    before = counters()
    vector = pinned_empty(100_000_001)  # (an odd size: no block cached by an earlier test fits it exactly)
    assert vector.is_pinned() and vector.numel() == 100_000_001
    grown = [v - before.get(k, 0) for k, v in counters().items()]
    size = vector.numel() * 4
    assert max(grown) >= size and all(g < 1.1 * size for g in grown), (size, grown)
