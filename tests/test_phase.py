"""The phase rules of the steps schedule (peer/phase.py), alone: patience, giving up, realignment."""

from __future__ import annotations

from peer.phase import in_step_with, laggards, nobody_coming, projected_step, realign
from peer.progress import ProgressRecord
from peer.schedule import last_sync_step, next_sync_step, sync_step

H, P = 20, 2  # fragment 0 syncs after steps 20, 40, ...; fragment 1 (offset 10) after 30, 50, ...


def rec(pid: str, step: int, rounds=(3, 3), seeking=(), time: float = 100.0) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=step, round=rounds[0], rounds=list(rounds), digests=["d"] * len(rounds),
                          seeking=[list(s) for s in seeking], tokens_per_second=1.0, client_mode=False, time=time)


def view(*records: ProgressRecord) -> dict:
    return {r.peer_id: r for r in records}


def test_schedule_helpers():
    assert [sync_step(0, r, P, H) for r in (1, 2)] == [20, 40] and sync_step(1, 1, P, H) == 30
    assert last_sync_step(0, P, H) == 0 and last_sync_step(29, P, H) == 20 and last_sync_step(30, P, H) == 30
    assert next_sync_step(30, P, H) == 40 and next_sync_step(31, P, H) == 40


def test_laggards_are_the_live_peers_that_have_not_reached_the_launch_step():
    records = view(rec("me", 40), rec("a", 39), rec("b", 40), rec("c", 55), rec("d", 2))
    assert laggards(records, "me", 40) == ["a", "d"]
    assert laggards(view(rec("me", 40)), "me", 40) == []


def test_nobody_coming_when_every_other_peer_left_the_round_without_it():
    # round 2 of fragment 0 was launched at step 40
    gone = view(rec("me", 40, rounds=(1, 1)), rec("a", 47, rounds=(1, 1)), rec("b", 61, rounds=(1, 1)))
    assert "left this round" in nobody_coming(gone, "me", launch_step=40, fragment=0, round_=2)
    still_in_it = view(rec("a", 47, rounds=(1, 1), seeking=[(0, 2)]), rec("b", 61, rounds=(1, 1)))
    assert nobody_coming(still_in_it, "me", launch_step=40, fragment=0, round_=2) is None  # tau > 0: a seeks it
    at_launch = view(rec("a", 40, rounds=(1, 1)), rec("b", 61, rounds=(1, 1)))
    assert nobody_coming(at_launch, "me", launch_step=40, fragment=0, round_=2) is None  # a is at it (blocked)
    applied = view(rec("a", 47, rounds=(2, 1)))
    assert nobody_coming(applied, "me", launch_step=40, fragment=0, round_=2) is None  # late: state_transfer's rule
    assert nobody_coming(view(rec("me", 40)), "me", launch_step=40, fragment=0, round_=2) is None  # alone: no


def test_projected_step():
    kw = dict(now=102.0, H=H, num_fragments=P)
    assert projected_step(rec("a", 41, time=100.0), step_seconds=0.5, **kw) == 45  # 2 s at 0.5 s per step
    assert projected_step(rec("a", 41, time=100.0), step_seconds=0.1, **kw) == 50  # not past its next sync
    assert projected_step(rec("a", 40, time=90.0), step_seconds=0.1, **kw) == 40  # at a sync: maybe blocked
    assert projected_step(rec("a", 41, time=100.0), step_seconds=None, **kw) == 41  # our speed unknown
    assert projected_step(rec("a", 55, seeking=[(1, 2), (0, 2)]), step_seconds=0.1, **kw) == 40  # the earliest
    assert projected_step(rec("a", 55, seeking=[(0, 99)]), step_seconds=0.1, **kw) == 55  # never past its step


def test_in_step_with():
    assert in_step_with(rec("a", 0, rounds=(3, 2)), [3, 3])  # one round late: same phase
    assert not in_step_with(rec("a", 0, rounds=(1, 3)), [3, 3])  # trained alone: it will move back itself
    assert not in_step_with(rec("a", 0, rounds=(3,)), [3, 3])


def test_realign_moves_up_to_just_before_the_round_the_lead_is_at():
    kw = dict(my_rounds=[3, 3], step_seconds=0.1, min_lag_seconds=30.0, H=H, num_fragments=P, now=100.0)
    records = view(rec("me", 12), rec("lead", 95, time=100.0), rec("slow", 60, time=100.0))
    move = realign(records, "me", my_step=12, **kw)
    assert (move.step, move.lead, move.behind_steps) == (89, "lead", 83)  # launches fragment 1 at 90 next
    seeking = view(rec("lead", 95, seeking=[(0, 4)], time=100.0))  # blocked at 80, looking for a group
    assert realign(seeking, "me", my_step=12, **kw).step == 79
    assert realign(records, "me", my_step=88, **kw) is None  # 7 steps (0.7 s) behind: patience covers it
    far_in_time = dict(kw, step_seconds=5.0)  # 7 steps at 5 s each: 35 s, more than patience would wait
    assert realign(records, "me", my_step=81, **far_in_time).step == 89
    assert realign(records, "me", my_step=120, **kw) is None  # never back
    stale = view(rec("alone", 400, rounds=(1, 3), time=100.0))  # ran on alone with an old state: not followed
    assert realign(stale, "me", my_step=12, **kw) is None
    unmeasured = dict(kw, step_seconds=None)  # right after a restart: a whole H behind is enough
    assert realign(records, "me", my_step=12, **unmeasured).step == 89
    assert realign(view(rec("me", 12)), "me", my_step=12, **kw) is None
