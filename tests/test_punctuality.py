"""How long a group we lead waits for each peer (peer/net/view/punctuality.py): pure, no network."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from peer.net.view.attendance import STRANGERS
from peer.net.view.punctuality import Punctuality, waits

ME, A, B, LATE = "M" * 46, "A" * 46, "B" * 46, "L" * 46
WANTED = frozenset({ME, A, B, LATE})


def test_nobody_keeps_the_group_waiting_before_most_of_the_expected_peers_joined():
    still, waited = waits(WANTED, {ME: 0.0, A: 1.0}, now=50.0, quorum=3, allowance=lambda p: 0.0, me=ME)
    assert still == WANTED and waited is None


def test_a_peer_is_waited_for_its_allowance_past_the_quorum_then_no_longer():
    joined = {ME: 0.0, A: 1.0, B: 4.0}  # the quorum (3 of 4) was in at 4.0
    allowance = {LATE: 2.0}.get
    still, waited = waits(WANTED, joined, now=5.5, quorum=3, allowance=lambda p: allowance(p, 10.0), me=ME)
    assert still == WANTED and waited == {A: 0.0, B: 0.0, LATE: 1.5}
    still, waited = waits(WANTED, joined, now=6.0, quorum=3, allowance=lambda p: allowance(p, 10.0), me=ME)
    assert still == WANTED - {LATE} and waited == {A: 0.0, B: 0.0, LATE: 2.0}
    # the group assembles without it; had it come at 5.0, it would have been charged one second
    still, waited = waits(WANTED, {**joined, LATE: 5.0}, now=5.0, quorum=3, allowance=lambda p: 2.0, me=ME)
    assert still == WANTED and waited == {A: 0.0, B: 0.0, LATE: 1.0}


def test_a_peer_that_joined_after_the_quorum_is_charged_from_the_quorum_on():
    joined = {ME: 0.0, A: 1.0, B: 2.0, LATE: 9.0}
    _, waited = waits(WANTED, joined, now=9.0, quorum=2, allowance=lambda p: 10.0, me=ME)
    assert waited == {A: 0.0, B: 1.0, LATE: 8.0}


def test_a_peer_late_at_every_round_costs_at_most_the_per_round_wait_once_its_allowance_is_spent():
    p = Punctuality(per_round=2.0, cap=10.0)
    met = {A, LATE}.__contains__
    costs = []
    for _ in range(6):
        allowed = p.allowance(LATE, met)
        costs.append(min(9.0, allowed))  # it comes 9 s after the quorum, or is dropped at its allowance
        p.settle({A: 0.0, LATE: costs[-1]}, met, live=[A, LATE])
    assert costs == [9.0, 3.0, 2.0, 2.0, 2.0, 2.0]
    assert p.allowance(A, met) == 10.0  # one always on time keeps the whole matchmaking_time


def test_an_allowance_builds_up_again_while_its_peer_comes_on_time():
    p = Punctuality(per_round=2.0, cap=10.0)
    met = {LATE}.__contains__
    p.settle({LATE: 10.0}, met, live=[LATE])
    assert p.allowance(LATE, met) == 2.0
    for expected in (4.0, 6.0, 8.0, 10.0, 10.0):
        p.settle({LATE: 0.0}, met, live=[LATE])
        assert p.allowance(LATE, met) == expected


def test_strangers_share_one_allowance_and_peers_no_longer_live_are_forgotten():
    p = Punctuality(per_round=1.0, cap=10.0)
    met = {A}.__contains__
    p.settle({"s1": 3.0, "s2": 9.0, A: 5.0}, met, live=["s1", "s2", A])
    assert p.allowance("s3", met) == p.allowance("s1", met) == 2.0  # the longest wait among strangers, + 1
    assert p.allowance(A, met) == 6.0
    p.settle({}, met, live=[])
    assert p.allowance(A, met) == 10.0 and p.allowance(STRANGERS, met) == 2.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=60.0), min_size=1, max_size=40),
       st.floats(min_value=0.5, max_value=5.0), st.floats(min_value=5.0, max_value=30.0))
def test_what_one_peer_costs_a_leader_is_bounded_whenever_it_comes(lateness, per_round, cap):
    """However a peer times its arrivals (``lateness``: seconds past the quorum, round by round), the rounds a
    leader leads wait for it at most ``cap`` plus ``per_round`` a round after the first in all: the bound one
    stranger or one slow partner puts on the swarm's time."""
    p = Punctuality(per_round=per_round, cap=cap)
    met = {LATE}.__contains__
    total = 0.0
    for late in lateness:
        allowed = p.allowance(LATE, met)
        comes = late <= allowed  # else the group assembles without it once its allowance ran out
        joined = {ME: 0.0, A: 0.0, **({LATE: late} if comes else {})}  # (the quorum was in at 0)
        still, waited = waits(frozenset({ME, A, LATE}), joined, now=min(late, allowed), quorum=2,
                              allowance=lambda peer: p.allowance(peer, met), me=ME)
        assert waited is not None and (LATE in still) == comes
        total += waited[LATE]
        p.settle(waited, met, live=[A, LATE])
        assert 0.0 <= p.allowance(LATE, met) <= cap
    assert total <= cap + per_round * (len(lateness) - 1) + 1e-6
