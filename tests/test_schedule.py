"""The clock schedule (volunteer swarms): rounds at fixed swarm times, joiners adopt the current round."""

import pytest

from peer.outer.schedule import ClockSchedule, StepsSchedule


class FakeClock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def test_clock_rounds_start_at_t0_plus_r_plus_p_over_P_times_T():
    clock = FakeClock(1000.0)  # T = 10, P = 2: fragment 0 at 1000, 1010, ...; fragment 1 at 1005, 1015, ...
    sched = ClockSchedule(10.0, 2, origin=0.0, clock=clock)
    assert sched.last == [100, 99]  # joined at t = 1000: adopts the current rounds, launches none of them
    assert [sched.due(1, p) for p in (0, 1)] == [None, None]
    clock.t = 1004.9
    assert [sched.due(2, p) for p in (0, 1)] == [None, None]
    clock.t = 1005.0
    assert [sched.due(3, p) for p in (0, 1)] == [None, 100]
    assert sched.due(4, 1) is None  # once per round, however many steps pass
    clock.t = 1010.2
    assert [sched.due(5, p) for p in (0, 1)] == [101, None]
    clock.t = 1047.0  # a peer that was suspended for a while skips the rounds it missed
    assert [sched.due(6, p) for p in (0, 1)] == [104, 104]
    assert "in 3s" == sched.describe_next(6)


def test_clock_origin_shifts_rounds_and_bad_period_rejected():
    sched = ClockSchedule(60.0, 1, origin=30.0, clock=FakeClock(90.0))
    assert sched.current_round(0) == 1
    with pytest.raises(ValueError):
        ClockSchedule(0.0, 1, clock=FakeClock(0.0))


def test_steps_schedule_describes_the_next_sync_step():
    assert StepsSchedule(20, 2).describe_next(20) == "@30"
