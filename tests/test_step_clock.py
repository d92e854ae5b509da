"""bench/step_clock.py: the steps a clock reports, and the idle gaps it finds in a profiler's trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from step_clock import StepClock, idle_gaps  # noqa: E402


def test_steps_count_the_steps_since_the_last_launch():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    for label in ("", "launch 0", "", "apply 0", "launch apply 1", ""):
        clock.mark(label)
    steps = clock.steps()
    assert [s.after_launch for s in steps] == [None, 0, 1, 2, 0, 1]
    assert all(s.lead is None and s.host == s.seconds >= 0 for s in steps)


def test_idle_gaps_name_the_host_op_the_training_stream_waited_for(tmp_path):
    def x(cat, name, ts, dur, tid):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [x("kernel", f"k{i}", 1000 * i, 1000, 7) for i in range(3)]  # the training stream, busy to 3 ms
    events += [x("kernel", "k3", 33_000, 1000, 7), x("kernel", "k4", 34_500, 1000, 7)]  # 30 ms idle, then 0.5 ms
    events += [x("kernel", "side", 10_000, 500, 13), x("gpu_memcpy", "copy", 5000, 9000, 13)]
    events += [x("cpu_op", "inner.step", 0, 40_000, 800),
               x("cpu_op", "evaluate_function: MulBackward0", 2500, 30_300, 814),
               x("cpu_op", "aten::mul", 2500, 50, 814)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = idle_gaps(str(path))
    lines = text.splitlines()
    assert lines[0] == "training stream 7: 5 kernels over 35.5 ms, idle 1 times for at least 1 ms, 30.0 ms in all"
    assert lines[1] == "  30.0 ms at +3.0 ms, inside evaluate_function: MulBackward0 (thread 814, 30.3 ms)"
    assert len(lines) == 2
    assert idle_gaps(str(path), min_ms=0.4).count("\n") == 2  # (the 0.5 ms gap too)
