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
import json
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
    host: float  # the host's time from the previous step's end to this one's (a stall there may idle the device
    # mid-step and still leave a lead at its end)
    after_launch: Optional[int] = None  # steps since the last step that launched a round (None: none yet)


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
        launched: Optional[int] = None
        for i, ((h_prev, e_prev, _), (h, e, label)) in enumerate(zip(self._marks, self._marks[1:])):
            if label.startswith("launch"):
                launched = i
            after = None if launched is None else i - launched
            if self.cuda:
                d_prev, d = e0.elapsed_time(e_prev) / 1e3, e0.elapsed_time(e) / 1e3
                seconds, lead = d - d_prev, d - (h - h0)
            else:
                seconds, lead = h - h_prev, None
            out.append(Step(label=label, seconds=seconds, lead=lead, host=h - h_prev, after_launch=after))
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


def idle_gaps(trace: str, min_ms: float = 1.0, show: int = 8) -> str:
    """The training stream's idle gaps in a chrome trace (``profile_table``'s, gzipped or not): each gap of at least
    ``min_ms`` with the innermost host op that began before it and lasted past its middle (the op the host was stuck
    in while the device waited: the next kernel starts a little after the host launches it). The training stream is
    the one that ran the most kernels."""
    with (gzip.open(trace, "rt") if trace.endswith(".gz") else open(trace)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels: dict[Any, list] = {}
    for e in spans:
        if e.get("cat") == "kernel":
            kernels.setdefault(e.get("tid"), []).append(e)
    if not kernels:
        return "no kernels in the trace"
    stream = max(kernels, key=lambda k: len(kernels[k]))
    run = sorted(kernels[stream], key=lambda e: e["ts"])
    t0, end, gaps = run[0]["ts"], run[0]["ts"] + run[0]["dur"], []
    for e in run[1:]:
        if e["ts"] - end >= 1e3 * min_ms:
            gaps.append((end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    host = [e for e in spans if e.get("cat") == "cpu_op"]
    lines = [f"training stream {stream}: {len(run)} kernels over {(end - t0) / 1e3:.1f} ms, idle {len(gaps)} times for "
             f"at least {min_ms:g} ms, {sum(b - a for a, b in gaps) / 1e3:.1f} ms in all"]
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:show]:
        around = [e for e in host if e["ts"] <= a and e["ts"] + e["dur"] >= (a + b) / 2]
        inner = min(around, key=lambda e: e["dur"], default=None)
        what = (f"{inner['name']} (thread {inner.get('tid')}, {inner['dur'] / 1e3:.1f} ms)" if inner
                else "no host op (Python, or a wait outside torch's ops)")
        lines.append(f"  {(b - a) / 1e3:.1f} ms at +{(a - t0) / 1e3:.1f} ms, inside {what}")
    return "\n".join(lines)
