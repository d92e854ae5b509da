"""Deadlines that follow the measured links (peer/net/flow/links.py): the arithmetic, the uplink meter, and the
reducers' part times on real daemons. The swarm-level check (a slow member's rounds complete with measured
deadlines) is tests/test_links_swarm.py; fixed against measured on shaped links is bench/uneven_links.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import run_async
from peer.config import MBIT
from peer.net.flow.bandwidth import MIN_RATE
from peer.net.round.group import member_spans
from peer.net.flow.links import (DeadlinePolicy, LinkMeter, round_deadlines, slow_donors_last, state_deadline,
                             wire_bytes)
from peer.outer.aggregate import AggregationRule, Aggregator
from peer.outer.codec import get_codec
from test_allreduce import _run

E3M0, FP8 = get_codec("e3m0"), get_codec("fp8")
POLICY = DeadlinePolicy(part_floor=30.0, allreduce_floor=60.0, state_floor=60.0, margin=3.0, ceiling=600.0)
NUMEL = 40_000_000  # a 40M-parameter fragment (no tensor of it is made: the deadlines are arithmetic)


def pair(d) -> tuple[float, float]:
    return d.part, d.allreduce


def spans(n: int, numel: int = NUMEL) -> list[tuple[int, int]]:
    return member_spans(numel, [False] * n, E3M0.block_size)


def test_fixed_deadlines_and_groups_nobody_measured_keep_the_settings():
    fixed = DeadlinePolicy(measured=False, part_floor=30.0, allreduce_floor=60.0)
    slow = [0.1 * MBIT] * 4
    assert pair(round_deadlines(spans(4), slow, [0.0] * 4, E3M0, E3M0, fixed)) == (30.0, 60.0)
    unmeasured = round_deadlines(spans(4), [0.0] * 4, [0.0] * 4, E3M0, E3M0, POLICY)
    assert (unmeasured.part, unmeasured.allreduce, unmeasured.expected) == (30.0, 60.0, 0.0)
    # a fast swarm: the links predict a few seconds, the floors stand
    fast = round_deadlines(spans(4), [100 * MBIT] * 4, [0.0] * 4, E3M0, E3M0, POLICY)
    assert (fast.part, fast.allreduce) == (30.0, 60.0) and 0 < fast.expected < 10


def test_one_slow_uplink_stretches_both_stages_by_its_bytes():
    """Member 3 of 4 on a 3 Mbit/s uplink: it sends its parts of the three other spans (stage 1), then its own
    span's average to the three others (stage 2); each stage's deadline is margin x those bytes / its uplink."""
    ups = [100 * MBIT, 100 * MBIT, 100 * MBIT, 3 * MBIT]
    got = round_deadlines(spans(4), ups, [0.0] * 4, E3M0, E3M0, POLICY)
    quarter = wire_bytes(E3M0, NUMEL // 4)
    stage = 3 * quarter / (3 * MBIT)  # the same bytes both ways: three parts out, then three copies of one average
    assert got.part == pytest.approx(3.0 * stage, rel=0.01) and got.part > 100  # ~127 s where 30 s failed
    assert got.allreduce == pytest.approx(got.part + 3.0 * stage, rel=0.01)
    assert got.expected == pytest.approx(2 * stage, rel=0.01)
    # a reducer's declared download cap bounds stage 1 too: three parts of its span in through 1 Mbit/s
    capped = round_deadlines(spans(4), [100 * MBIT] * 4, [0.0, 0.0, 1 * MBIT, 0.0], E3M0, E3M0, POLICY)
    assert capped.part == pytest.approx(3.0 * 3 * quarter / MBIT, rel=0.01)


def test_hostile_declarations_are_ignored_or_bounded_by_the_ceiling():
    # not finite: as if not declared
    assert pair(round_deadlines(spans(3), [math.nan, math.inf, -5.0], [math.nan] * 3, E3M0, E3M0, POLICY)) == (30, 60)
    # a tiny uplink counts as MIN_RATE, and the ceiling holds; the average stage keeps the settings' gap
    tiny = round_deadlines(spans(3), [1.0, 100 * MBIT, 100 * MBIT], [0.0] * 3, E3M0, E3M0, POLICY)
    assert tiny.allreduce == 600.0 and tiny.part == 600.0 - 30.0
    assert tiny.expected == pytest.approx(2 * 2 * wire_bytes(E3M0, NUMEL // 3) / MIN_RATE, rel=0.01)


rates = st.one_of(st.just(0.0), st.floats(min_value=1.0, max_value=1e10), st.just(math.nan))


@settings(max_examples=200, deadline=None)
@given(ups=st.lists(rates, min_size=1, max_size=12), downs=st.data(), numel=st.integers(1, 1 << 30),
       floors=st.tuples(st.floats(0.5, 100.0), st.floats(0.1, 100.0)), ceiling=st.floats(0.0, 2000.0),
       margin=st.floats(1.0, 10.0))
def test_the_part_stage_ends_first_and_every_deadline_stays_within_its_bounds(ups, downs, numel, floors, ceiling,
                                                                            margin):
    part_floor, gap = floors
    policy = DeadlinePolicy(part_floor=part_floor, allreduce_floor=part_floor + gap, margin=margin, ceiling=ceiling)
    dl = downs.draw(st.lists(rates, min_size=len(ups), max_size=len(ups)))
    got = round_deadlines(spans(len(ups), numel), ups, dl, E3M0, E3M0, policy)
    assert got == round_deadlines(spans(len(ups), numel), ups, dl, E3M0, E3M0, policy)  # every member: the same
    assert part_floor <= got.part and got.part + gap <= got.allreduce + 1e-9
    assert got.allreduce <= max(ceiling, part_floor + gap) + 1e-9


def test_the_uplink_meter_takes_a_slowdown_at_once_and_a_speedup_gradually():
    meter = LinkMeter(smoothing=0.5)
    assert meter.rate() == 0.0 and meter.rate(cap=2e6) == 2e6  # nothing measured: the owner's cap, if any
    meter.observe(10_000_000, 10.0)  # 1 MB/s
    meter.observe(1_000, 0.001)  # too few bytes to time: skipped
    meter.observe(10_000_000, 0.0)  # no time: skipped
    assert meter.rate() == pytest.approx(1e6)
    meter.observe(10_000_000, 100.0)  # the link slowed to 100 kB/s: taken at once
    assert meter.rate() == pytest.approx(1e5)
    meter.observe(10_000_000, 10.0)  # faster again: half way
    assert meter.rate() == pytest.approx(0.55e6)
    assert meter.rate(cap=2e5) == 2e5  # never above the owner's cap


def test_a_state_donor_gets_the_time_its_share_takes_through_its_uplink():
    fixed = DeadlinePolicy(measured=False, state_floor=60.0)
    assert state_deadline(NUMEL, 3, 1e5, fixed) == 60.0
    assert state_deadline(NUMEL, 3, 0.0, POLICY) == 60.0  # not declared: the setting
    # 40M elements of G and v in fp32 from 3 donors on 10 Mbit/s, each serving 2 downloads at once
    assert state_deadline(NUMEL, 3, 10 * MBIT, POLICY) == pytest.approx(3.0 * 8 * NUMEL / 3 * 2 / (10 * MBIT))
    assert state_deadline(NUMEL, 1, 0.5 * MBIT, POLICY) == 600.0  # the ceiling
    # the joiner's own downlink, shared by its donors, when it is the slower: 3 donors into 20 Mbit/s
    assert state_deadline(NUMEL, 3, 100 * MBIT, POLICY, downlink=20 * MBIT) == pytest.approx(
        3.0 * 8 * NUMEL / 3 / (20 * MBIT / 3))
    assert state_deadline(NUMEL, 3, 0.0, POLICY, downlink=20 * MBIT) == state_deadline(NUMEL, 3, 100 * MBIT, POLICY,
                                                                                       downlink=20 * MBIT)


def test_slow_donors_go_last_and_the_others_keep_their_order():
    rates = {"a": 1 * MBIT, "b": 50 * MBIT, "c": 0.0, "d": 20 * MBIT, "e": 10 * MBIT, "f": math.nan}
    assert slow_donors_last(rates) == ["b", "c", "d", "f", "a", "e"]  # under 50/4 Mbit/s: a and e, in order
    assert slow_donors_last({"x": 0.0, "y": 0.0}) == ["x", "y"]


MEMBER_NUMEL = 400_000  # fp32 parts of 0.53 MB per span among three members


def three_members_one_capped(cap: float, **timeouts) -> dict:
    """One round of three members on real daemons (the plain mean), member 2 with an upload cap of ``cap``
    bytes/s; returns each member's AllReduceResult."""
    torch.manual_seed(3)
    deltas = [torch.randn(MEMBER_NUMEL) for _ in range(3)]
    results, _ = run_async(_run(3, [0, 1, 2], [1.0, 1.0, 1.0], deltas, rule=AggregationRule(kind=Aggregator.MEAN),
                                numel=MEMBER_NUMEL, uploads=[0.0, 0.0, cap], **timeouts))
    return results


def test_reducers_time_a_members_parts_and_it_learns_its_uplink():
    """Three members on real daemons, member 2 with an 8 Mbit/s upload cap: the reducers' part times give it an
    uplink at most its cap (its parts cannot have left faster), while the uncapped members measure far more."""
    cap = 8 * MBIT
    results = three_members_one_capped(cap, part_timeout=30.0, allreduce_timeout=60.0, chunk_bytes=64 * 1024)
    assert all(r.complete for r in results.values())
    rates = {}
    for i, r in results.items():
        assert r.uplink is not None
        sent, seconds = r.uplink
        assert sent > 2 * 4 * MEMBER_NUMEL / 3 * 0.99  # its fp32 parts of the two other spans
        rates[i] = sent / seconds
    assert rates[2] <= 1.5 * cap, rates  # (the pacer's burst allowance lets a little go early)
    assert min(rates[0], rates[1]) > 2 * rates[2], rates


def test_a_part_too_slow_for_the_deadline_still_teaches_its_member_its_uplink():
    """Member 2's parts need ~8.5 s through its 1 Mbit/s cap and the reducers wait 3 s: they refuse the parts, and
    say how much arrived in that time, so the member learns its uplink from a round that failed (and its next
    groups size their deadlines for it) instead of staying unmeasured on the fixed floors for ever."""
    cap, part_timeout, allreduce_timeout = 1 * MBIT, 3.0, 6.0  # (3 s: the uncapped parts arrive on a loaded host)
    results = three_members_one_capped(cap, part_timeout=part_timeout, allreduce_timeout=allreduce_timeout,
                                       chunk_bytes=16 * 1024)
    assert not results[2].complete and results[0].contributors[0] == [0, 1]  # its parts came too late
    assert results[2].uplink is not None
    sent, seconds = results[2].uplink
    assert 0 < sent < 2 * 4 * MEMBER_NUMEL / 3 and seconds <= allreduce_timeout
    assert sent / seconds <= 1.5 * cap, (sent, seconds)
    meter = LinkMeter()
    meter.observe(sent, seconds)  # (enough bytes to time: the swarm's meter takes it)
    assert meter.rate() == sent / seconds
