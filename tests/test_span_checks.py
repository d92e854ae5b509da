"""A member's checks of span results (peer/net/trust/span_checks.py), alone: honest results of the robust rule are
never refused, whatever the group size, the noise and the members' weights; a reducer that flips, replaces
or zeroes its span's result is caught by every member that can judge."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.net.trust.span_checks import MIN_ELEMENTS, MIN_REFERENCE, cosine, disagreeing
from peer.outer.aggregate import AggregationRule, aggregate, vouched_caps


def round_of(seed: int, n: int, span: int, signal: float, speeds: list[int]):
    """Every member's outer gradient (n spans of ``span`` elements; a shared direction of strength ``signal``
    per step plus each member's noise) and each span's result under the default rule, caps vouched."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n * span, generator=g)
    deltas = [s * signal * common + math.sqrt(s) * torch.randn(n * span, generator=g) for s in speeds]
    weights = [float(s) for s in speeds]
    caps = vouched_caps(weights, AggregationRule())
    results = {j: aggregate([d[j * span:(j + 1) * span] for d in deltas], weights, AggregationRule(), caps).value
               for j in range(n)}
    return deltas, results


def parts_of(delta: torch.Tensor, n: int, span: int) -> dict[int, torch.Tensor]:
    return {j: delta[j * span:(j + 1) * span] for j in range(n)}


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 8), span=st.sampled_from([4096, 16384]),
       signal=st.sampled_from([0.0, 0.05, 0.3, 1.0]), speed=st.lists(st.sampled_from([1, 2, 4]), min_size=8,
                                                                       max_size=8))
def test_honest_results_are_never_refused(seed, n, span, signal, speed):
    """Pure noise (signal 0) to a strong shared direction; equal or unequal speeds; each member checks with
    its own span as the reference, and (a client-mode member) without one."""
    deltas, results = round_of(seed, n, span, signal, speed[:n])
    for i in range(n):
        ours = parts_of(deltas[i], n, span)
        assert disagreeing(results, ours, own=i) == {}
        assert disagreeing(results, ours, own=None) == {}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 8), span=st.sampled_from([4096, 16384]),
       signal=st.sampled_from([0.0, 0.3, 1.0]), lie=st.sampled_from(["flip", "noise", "zero", "other_span"]))
def test_a_reducer_that_replaces_its_result_is_caught_by_every_member_that_can_judge(seed, n, span, signal, lie):
    """Reducer 0 replaces its span's result: its negation, fresh noise of the same size, zeros, or another
    span's honest result. Every other member that reduces a span of its own refuses it (when its reference
    cosine is at least MIN_REFERENCE, as it is for equal members: 1/sqrt(n) at least); so does a member
    without a span of its own once three or more spans tell the median."""
    deltas, results = round_of(seed, n, span, signal, [1] * n)
    honest = results[0]
    g = torch.Generator().manual_seed(seed + 7)
    results[0] = {"flip": -honest, "noise": torch.randn(span, generator=g) * honest.norm() / math.sqrt(span),
                  "zero": torch.zeros(span), "other_span": results[1]}[lie]
    for i in range(1, n):
        ours = parts_of(deltas[i], n, span)
        reference = cosine(results[i], ours[i])
        assert reference is not None and reference >= MIN_REFERENCE
        assert set(disagreeing(results, ours, own=i)) == {0}, (i, cosine(results[0], ours[0]), reference)
        if n >= 3:
            assert set(disagreeing(results, ours, own=None)) == {0}


def test_spans_where_our_part_is_zero_or_that_are_short_are_not_judged():
    n = MIN_ELEMENTS
    results = {0: torch.ones(n), 1: -torch.ones(n)}
    assert disagreeing(results, {0: torch.ones(n), 1: torch.zeros(n)}, own=0) == {}
    assert set(disagreeing(results, {0: torch.ones(n), 1: torch.ones(n)}, own=0)) == {1}
    short = {j: r[:n - 1] for j, r in results.items()}
    assert disagreeing(short, {0: torch.ones(n - 1), 1: torch.ones(n - 1)}, own=0) == {}
    assert cosine(torch.zeros(3), torch.ones(3)) == 0.0 and cosine(torch.ones(3), torch.zeros(3)) is None
