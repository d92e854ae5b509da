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
            watch.caught_up([42.0])
        said.append(watch.verdict(125_000.0))
    lines = [s for s in said if s]
    assert len(lines) == 1 and said.index(lines[0]) == 7, said  # at the 8th round, once
    assert "8 rounds averaged nothing" in lines[0] and "2 times (2 fragments delivered, median 42 s" in lines[0]
    assert "1.0 Mbit/s" in lines[0] and "outer.sync_every" in lines[0] and "clock" in lines[0]
    watch.round(S.OK)  # it averaged again: a new streak may be told again
    for _ in range(8):
        watch.round(S.BEHIND)
        watch.caught_up([10.0])
    again = watch.verdict()  # (uplink not measured: not named)
    assert again is not None and "Mbit/s" not in again and watch.verdict() is None


def test_alone_unmatched_or_averaging_peers_are_not_out_of_pace():
    alone = PaceWatch(schedule="clock")
    for _ in range(50):  # nobody to keep pace with
        alone.round(S.ALONE)
    alone.caught_up([5.0])
    alone.caught_up([5.0])
    alone.caught_up([])  # (nothing planned: not a catch-up)
    assert alone.verdict() is None
    unmatched = PaceWatch(schedule="clock")
    for _ in range(50):  # no group, but never behind the swarm's state: not the slow-link pattern
        unmatched.round(S.NO_GROUP)
    assert unmatched.verdict() is None
    partial = PaceWatch(schedule="clock")
    for i in range(50):  # partial rounds apply spans: it averages
        partial.round(S.PARTIAL if i % 4 == 0 else S.BEHIND)
        partial.caught_up([5.0, 5.0])
    assert partial.verdict() is None
    clock = PaceWatch(schedule="clock", rounds=2, downloads=1)
    clock.round(S.BEHIND)
    clock.round(S.BEHIND)
    clock.caught_up([3.0])
    assert "outer.round_seconds" in (clock.verdict() or "")


def test_a_member_whose_downloads_outlast_the_rounds_is_told_after_three_catch_ups():
    """The shaped-link bench's 1 Mbit/s member: each catch-up takes ~50 s, so it launches few rounds between them;
    three catch-ups with no round averaged between them say it, whatever the round count. A fast peer in the same
    pattern (its only donor a slow, busy peer) is not told its link is too slow."""
    watch = PaceWatch(schedule="clock")
    watch.caught_up([1.0])  # joining
    watch.round(S.OK)  # averaged once: a rejoining peer is fine
    watch.round(S.BEHIND)
    watch.caught_up([51.0, 58.0])
    assert watch.verdict() is None  # (a rejoin may take two)
    watch.round(S.BEHIND)
    watch.caught_up([], failed=1)  # the swarm moved past the round it fetched
    watch.caught_up([50.0])
    swarm = [6.2e6 / 8, 6.0e6 / 8, 0.5e6 / 8]  # the other live records' declared uplinks (bytes/s)
    line = watch.verdict(0.5e6 / 8, swarm)
    assert line is not None and "2 rounds averaged nothing" in line and "3 times (3 fragments delivered, median 51 s" \
        in line and "0.5 Mbit/s" in line and "outer.round_seconds" in line
    fast = PaceWatch(schedule="clock")
    fast.round(S.BEHIND)
    for _ in range(3):
        fast.caught_up([], failed=2)  # its only donor a slow peer, busy serving others
    assert fast.out_of_pace and fast.verdict(6.5e6 / 8, [6.2e6 / 8, 0.5e6 / 8, 0.5e6 / 8]) is None  # not its link
    assert fast.verdict(6.5e6 / 8, [60e6 / 8, 50e6 / 8, 0.5e6 / 8]) is not None  # (against fibre it is the slow one)
    assert watch.verdict() is None  # once per streak
    rejoin = PaceWatch(schedule="clock")
    for _ in range(10):  # one or two catch-ups, then an averaged round: never out of pace
        rejoin.caught_up([20.0])
        rejoin.round(S.BEHIND)
        rejoin.caught_up([20.0])
        rejoin.round(S.OK)
        assert rejoin.verdict() is None


def test_a_peer_whose_downloads_were_quick_is_not_told_its_link_is_slow():
    """A loopback peer left behind by one round (a group that listed a member that had left) may catch up three
    times in three seconds while the swarm moves on (5 fragments, ~0.1 s each): its link is not what holds it
    back. Quick downloads are not the slow-link pattern; slow ones from the same peer are."""
    for seconds, told in ((0.1, False), (12.0, True)):
        watch = PaceWatch(schedule="steps")
        watch.round(S.PARTIAL)
        for _ in range(3):
            watch.round(S.BEHIND)
            watch.caught_up([seconds, seconds])
        assert watch.out_of_pace
        assert (watch.verdict(66.8e6 / 8, [300e6 / 8, 280e6 / 8]) is not None) == told, seconds
