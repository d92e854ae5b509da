"""Whether a peer keeps the swarm's pace (peer/run/pace.py): pure."""

from __future__ import annotations

from peer.outer.rounds import RoundStatus
from peer.run.pace import PaceWatch

S = RoundStatus


def test_a_member_that_keeps_downloading_and_never_averages_is_told_once_per_streak():
    watch = PaceWatch(schedule="steps", rounds=8, downloads=2)
    said = []
    for i in range(20):  # the slow member of the uneven-links bench: behind, download, behind, ...
        watch.round(S.BEHIND if i % 3 else S.NO_GROUP)
        if i % 4 == 3:
            watch.caught_up(42.0)
        said.append(watch.verdict(125_000.0))
    lines = [s for s in said if s]
    assert len(lines) == 1 and said.index(lines[0]) == 7, said  # at the 8th round, once
    assert "8 rounds averaged nothing" in lines[0] and "2 times (median 42 s" in lines[0]
    assert "1.0 Mbit/s" in lines[0] and "outer.sync_every" in lines[0] and "clock" in lines[0]
    watch.round(S.OK)  # it averaged again: a new streak may be told again
    for _ in range(8):
        watch.round(S.BEHIND)
        watch.caught_up(10.0)
    again = watch.verdict()  # (uplink not measured: not named)
    assert again is not None and "Mbit/s" not in again and watch.verdict() is None


def test_alone_unmatched_or_averaging_peers_are_not_out_of_pace():
    alone = PaceWatch(schedule="clock")
    for _ in range(50):  # nobody to keep pace with
        alone.round(S.ALONE)
    alone.caught_up(5.0)
    alone.caught_up(5.0)
    assert alone.verdict() is None
    unmatched = PaceWatch(schedule="clock")
    for _ in range(50):  # no group, but never behind the swarm's state: not the slow-link pattern
        unmatched.round(S.NO_GROUP)
    assert unmatched.verdict() is None
    partial = PaceWatch(schedule="clock")
    for i in range(50):  # partial rounds apply spans: it averages
        partial.round(S.PARTIAL if i % 4 == 0 else S.BEHIND)
        partial.caught_up(5.0)
    assert partial.verdict() is None
    clock = PaceWatch(schedule="clock", rounds=2, downloads=1)
    clock.round(S.BEHIND)
    clock.round(S.BEHIND)
    clock.caught_up(3.0)
    assert "outer.round_seconds" in (clock.verdict() or "")
