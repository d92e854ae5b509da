"""Where a loop's extra time goes, step by step: on the device's own timeline, and how far the device ran behind.

A :class:`StepClock` marks the end of every step: on CUDA a timing event recorded on the current stream beside the
host's clock, on the CPU the host's clock alone. From the marks, each step's length on the device and the device's
*lead*: how long after the host enqueued a step's end the device reached it. A lead near zero means the device had
caught up with the host (it waited for work: the host was the bound then); a step longer than the plain loop's with
a large lead means the device itself was slower (other work on it, or copies). Contract: ``start()`` before the
first step of a block, ``mark(label)`` after each step, ``steps()`` once the block's work is done (it synchronizes).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import shutil
import statistics
import time
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    label: str  # what the step did besides training ("launch 3", "apply 3", or "")
    seconds: float  # the step's length on the device's timeline (the host's on the CPU)
    lead: Optional[float]  # the device's distance behind the host at the step's end (None on the CPU)


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: list[tuple[float, Any, str]] = []

    def _now(self) -> tuple[float, Any]:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def start(self) -> None:
        """Must be called with the device idle (after a synchronize): the host's and the device's clocks meet here."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._marks = [(*self._now(), "")]

    def mark(self, label: str = "") -> None:
        self._marks.append((*self._now(), label))

    def steps(self) -> list[Step]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        (h0, e0, _), out = self._marks[0], []
        for (h_prev, e_prev, _), (h, e, label) in zip(self._marks, self._marks[1:]):
            if self.cuda:
                d_prev, d = e0.elapsed_time(e_prev) / 1e3, e0.elapsed_time(e) / 1e3
                out.append(Step(label=label, seconds=d - d_prev, lead=d - (h - h0)))
            else:
                out.append(Step(label=label, seconds=h - h_prev, lead=None))
        return out


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's counters that mean a synchronizing call (cudaMalloc, cudaFree, a retry after freeing
    the cache); zeros on the CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                              "num_sync_all_streams")}


def counts_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def summary(plain: list[Step], peer: list[Step], *, slow: float = 1.1, show: int = 12) -> dict:
    """The peer's time over the plain loop's median step, by what the step did; its slowest steps; the device's lead."""
    base = statistics.median(s.seconds for s in plain)
    excess: dict[str, float] = {}
    for s in peer:
        kind = s.label.split(" ")[0] if s.label else "train only"
        excess[kind] = excess.get(kind, 0.0) + s.seconds - base
    slowest = sorted((s for s in peer if s.seconds > slow * base), key=lambda s: -s.seconds)[:show]
    leads = {name: [s.lead for s in steps if s.lead is not None] for name, steps in (("plain", plain), ("peer", peer))}
    return {
        "plain_median_s": base, "peer_median_s": statistics.median(s.seconds for s in peer),
        "excess_s_by_kind": excess,
        "slowest": [dataclasses.asdict(s) for s in slowest],
        "lead_s": {k: {"min": min(v), "median": statistics.median(v)} for k, v in leads.items() if v},
        "peer_steps_device_caught_up": sum(1 for s in peer if s.lead is not None and s.lead < 2e-3),
    }


def profile_table(fn, n_steps: int, device: torch.device, rows: int = 25, trace: str = "") -> str:
    """torch.profiler over ``n_steps`` calls of ``fn(i)``: the top rows by self device time and by self host time;
    with ``trace``, the timeline too, gzipped there (for chrome://tracing or Perfetto)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(n_steps):
            fn(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace:
        raw = trace.removesuffix(".gz")
        os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace if trace.endswith(".gz") else raw + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device.type == "cuda":
        tables.insert(0, averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    return "\n".join(tables)
