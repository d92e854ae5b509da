"""The training loop's bookkeeping (peer/run/throughput.py) on a clock of our own: the throughput's counts and the
loop's seconds by part, which add up to the time since the loop began."""

from __future__ import annotations

import pytest

from peer.run.throughput import LoopParts, Throughput


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parts_add_up_to_the_loop_time_and_each_mark_charges_only_its_part():
    clock = Clock()
    parts = LoopParts(clock)
    for step_s, launch_s, rest_s in [(0.5, 0.25, 0.0), (0.5, 0.0, 0.125), (0.25, 0.0, 0.0)]:
        clock.now += step_s
        assert parts.mark("step") == step_s and parts.last == clock.now
        clock.now += launch_s
        parts.mark("launch")
        clock.now += rest_s
        parts.mark("rest")
    assert parts.seconds == {"step": 1.25, "launch": 0.25, "rest": 0.125}
    assert sum(parts.seconds.values()) == pytest.approx(clock.now - 100.0)


def test_a_restart_counts_from_zero_and_keeps_the_step_time():
    clock = Clock()
    t = Throughput(clock)
    t.observe(tokens=128, seconds=0.5)
    t.parts.mark("step")
    clock.now += 2.0
    t.lap()
    assert (t.tokens, t.compute_seconds, t.elapsed, t.tokens_per_second) == (128, 0.5, 2.0, 64.0)
    before = t.step_time.value
    t.restart()
    assert (t.tokens, t.compute_seconds, t.parts.seconds) == (0, 0.0, {})
    assert t.step_time.value == before
