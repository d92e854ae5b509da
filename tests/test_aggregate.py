"""The reducer's aggregation rules (peer/outer/aggregate.py), alone: bounded influence of one arbitrary part,
the plain mean for honest parts of any speed, determinism and order independence, the vouched caps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.outer.aggregate import (MAX_WEIGHT, VOUCH_SLACK, AggregationRule, Aggregator, aggregate, capped_weights,
                                  center_of, centered_clip, coordinate_median, lower_median, rescale,
                                  sender_median, vouched_caps)
from peer.outer import aggregate as aggregate_module
from peer.outer.codec import get_codec

CLIPPED, MEAN = AggregationRule(), AggregationRule(kind=Aggregator.MEAN)
ATTACKS = ["scaled_1e3", "scaled_1e6", "sign_flip", "noise", "constant", "huge_finite", "zero"]


def honest_parts(seed: int, n: int, d: int, spread: float) -> list[torch.Tensor]:
    """Outer gradients of peers that trained the same weights on different data: a common direction plus
    each peer's own noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g)
    return [common + spread * torch.randn(d, generator=g) for _ in range(n)]


def attack(kind: str, honest: list[torch.Tensor], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    mean = torch.stack(honest).mean(0)
    return {"scaled_1e3": 1e3 * honest[0], "scaled_1e6": 1e6 * honest[0], "sign_flip": -10 * mean,
            "noise": 100 * torch.randn(mean.numel(), generator=g), "constant": torch.full_like(mean, 1e4),
            "huge_finite": torch.full_like(mean, 3e38), "zero": torch.zeros_like(mean)}[kind]


def weighted_mean(parts, weights):
    w = torch.tensor(weights, dtype=torch.float64)
    return (w / w.sum()).to(torch.float32) @ torch.stack(parts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n_honest=st.integers(2, 7), d=st.integers(1, 64),
       kind=st.sampled_from(ATTACKS), lie=st.sampled_from([1.0, 10.0, 1e6, MAX_WEIGHT]))
def test_one_arbitrary_part_moves_the_result_at_most_the_bound(seed, n_honest, d, kind, lie):
    """Against the same rule on the honest parts alone, with the attacker's part anywhere and its weight a lie:
    the center and the radius stay within the honest parts' reach, and with them fixed the attacker moves the
    result at most influence_bound."""
    honest = honest_parts(seed, n_honest, d, spread=0.3)
    assert_bounded_influence(honest, attack(kind, honest, seed), lie)


def assert_bounded_influence(honest: list[torch.Tensor], bad: torch.Tensor, lie: float) -> None:
    """The rule's bound with ``bad`` among ``honest`` and its weight ``lie`` times the largest honest one (also
    for sparse parts: tests/test_topk.py)."""
    weights = [1.0 + (i % 3) for i in range(len(honest))]  # heterogeneous honest peers (1x to 3x)
    parts, declared = honest + [bad], weights + [lie * max(weights)]
    out = aggregate(parts, declared, CLIPPED)
    assert torch.isfinite(out.value).all()
    used = out.weights
    assert used[-1] <= CLIPPED.weight_cap * max(weights) + 1e-9  # the lie counts at most weight_cap honest shares
    directions, ratios, _ = rescale(torch.stack(parts), [CLIPPED.length_cap] * len(parts))
    assert float(ratios[-1]) <= CLIPPED.length_cap  # and its length at most length_cap median lengths
    honest_dirs = directions[:-1]
    # (with n >= 3 the center, the coordinate-wise median or for sparse parts the sender median, lies within the
    # honest directions' range in every coordinate)
    lo, hi = honest_dirs.min(0).values, honest_dirs.max(0).values
    center = center_of(directions)
    assert bool(((center >= lo - 1e-5) & (center <= hi + 1e-5)).all())
    farthest = float(torch.linalg.vector_norm(honest_dirs - center, dim=1).max())
    assert out.radius <= CLIPPED.clip_factor * farthest * (1 + 1e-5) + 1e-6
    # with the center, the radius and the strengths fixed, the attacker's direction could be anything:
    # compare with it replaced by the center itself (no pull at all)
    a = torch.tensor(out.strengths, dtype=torch.float64)
    scale = float(a.sum()) / sum(used)
    attacked, _ = centered_clip(directions, a, center, out.radius, CLIPPED.iterations)
    calm, _ = centered_clip(torch.cat([honest_dirs, center[None]]), a, center, out.radius, CLIPPED.iterations)
    moved = scale * float(torch.linalg.vector_norm(attacked - calm))
    # Derived here, not read from the module: per CenteredClip iteration the center moves by the strengths-weighted
    # mean of clipped offsets, each at most ``radius`` long; the attacker's offset and the calm one (to the center
    # itself) differ by at most 2 * radius, weighted a_k / sum(a), and the iterations add up. Scaled back by
    # sum(a) / sum(used): 2 * iterations * radius * a_k / sum(used).
    bound = 2 * CLIPPED.iterations * out.radius * out.strengths[-1] / sum(used)
    assert moved <= bound * (1 + 1e-4) + 1e-5, (moved, bound)
    assert torch.allclose(scale * attacked, out.value, rtol=1e-5, atol=1e-5)


SPARSE_ATTACKS = ["lone", "swing", "outbid", "dense_noise"]


def sparse_honest_parts(seed: int, n: int, d: int, density: float) -> list[torch.Tensor]:
    """Sparse parts as a top-k codec with error feedback sends them: each peer keeps its own few coordinates of
    a shared direction plus its noise, the supports overlapping only partly."""
    g = torch.Generator().manual_seed(seed)
    full = honest_parts(seed, n, d, spread=0.5)
    return [p * (torch.rand(d, generator=g) < density) for p in full]


def sparse_attack(kind: str, honest: list[torch.Tensor], seed: int) -> torch.Tensor:
    """Parts aimed at the sender median: its own values where no honest part sends (``lone``); the opposite of
    every honest value, 100x (``swing``: at a coordinate one honest part sends, the center becomes zero); the
    same sign, 100x (``outbid``); dense noise among sparse parts."""
    stacked = torch.stack(honest)
    count = (stacked != 0).sum(0)
    g = torch.Generator().manual_seed(seed + 2)
    sign = torch.sign(stacked.sum(0))
    return {"lone": torch.where(count == 0, 10 * torch.randn(stacked.shape[1], generator=g), 0.0),
            "swing": -100 * sign, "outbid": 100 * sign,
            "dense_noise": 100 * torch.randn(stacked.shape[1], generator=g)}[kind]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n_honest=st.integers(2, 7), d=st.integers(1, 256),
       density=st.sampled_from([0.02, 0.1, 0.3, 0.45]), kind=st.sampled_from(ATTACKS + SPARSE_ATTACKS),
       lie=st.sampled_from([1.0, 1e6, MAX_WEIGHT]))
def test_one_arbitrary_part_among_sparse_parts_moves_the_result_at_most_the_bound(seed, n_honest, d, density, kind,
                                                                                  lie):
    """The sparse parts' center (the sender median) with one arbitrary part, aimed at it or not: the same
    assertions as for dense parts (the center within the honest range, the radius, the bound)."""
    honest = sparse_honest_parts(seed, n_honest, d, density)
    bad = (sparse_attack if kind in SPARSE_ATTACKS else attack)(kind, honest, seed)
    if float(lower_median(torch.stack([torch.linalg.vector_norm(p) for p in honest + [bad]]))) == 0.0:
        return  # at least half the parts are zero: so is the answer (tested below)
    assert_bounded_influence(honest, bad, lie)
    if all(2 * int((p != 0).sum()) < d for p in honest):  # one part cannot switch the sparse parts' center off
        directions, _, _ = rescale(torch.stack(honest + [bad]), [CLIPPED.length_cap] * (n_honest + 1))
        assert torch.equal(center_of(directions), sender_median(directions))


def test_the_sender_median_per_coordinate():
    """Two senders: the smaller value of one sign, zero for opposite signs (a zero joins an even count); three: the
    middle one; one or none: zero."""
    parts = torch.tensor([[1.0, 2.0, 2.0, 7.0, 0.0, 5.0],
                          [3.0, 0.0, -4.0, 0.0, 0.0, 6.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, -9.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    assert sender_median(parts).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert torch.equal(center_of(parts), sender_median(parts))  # 1 to 5 of 6 entries nonzero: sparse


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_honest=st.integers(2, 7), d=st.integers(2, 300),
       kind=st.sampled_from(ATTACKS + SPARSE_ATTACKS + ["fp4"]))
def test_dense_parts_keep_the_coordinate_median_whatever_one_part_is(seed, n_honest, d, kind):
    """The sparse center is used only where at least half the parts are sparse (a lower median): with dense
    honest parts (or FP4's, which have a few zeros) one part, sparse or not, cannot switch it, and the result is
    bit for bit the rule with the coordinate-wise median."""
    honest = honest_parts(seed, n_honest, d, spread=0.3)
    if kind == "fp4":
        fp4 = get_codec("e3m0")
        honest = [fp4.decode_flat(fp4.encode_flat(p)) for p in honest]
        bad = honest[0].clone()
    else:
        bad = (sparse_attack if kind in SPARSE_ATTACKS else attack)(kind, honest, seed)
    parts, weights = honest + [bad], [1.0 + (i % 3) for i in range(n_honest + 1)]
    out = aggregate(parts, weights, CLIPPED)
    used = capped_weights(weights, CLIPPED.weight_cap)
    directions, ratios, _ = rescale(torch.stack(parts), [CLIPPED.length_cap] * len(parts))
    center = coordinate_median(directions)
    assert torch.equal(center_of(directions), center)
    strength = torch.tensor(used, dtype=torch.float64) * ratios
    dist = torch.linalg.vector_norm(directions - center, dim=1).sort().values
    radius = CLIPPED.clip_factor * float(dist[dist.numel() // 2])
    if radius > 0:
        value, _ = centered_clip(directions, strength, center, radius, CLIPPED.iterations)
        assert torch.equal(out.value, value * float(strength.sum() / sum(used)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_sender_median_is_the_same_on_cuda():
    for seed in range(5):
        parts = torch.stack(sparse_honest_parts(seed, 7, 100_000, 0.05))
        parts[-1] = sparse_attack("swing", list(parts[:-1]), seed)
        assert torch.equal(center_of(parts.cuda()).cpu(), center_of(parts))
        assert torch.equal(sender_median(parts.cuda()).cpu(), sender_median(parts))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), d=st.integers(64, 512))
def test_honest_parts_give_the_plain_weighted_mean(seed, n, d):
    """Peers whose outer gradients share a direction (spread 0.1 of it) and whose weights differ up to 2x
    (weight_cap): no weight is capped, and the rule is the plain mean within 2.5% of its norm (the parts beyond
    the median distance are pulled in to it: with clip_factor 1 about half of them, by the spread of the
    distances, ~10% of 0.1; over 2,400 draws of n 3-8 and d 64/512: mean 0.16%, 99th percentile 0.86%, worst
    1.9%). With a radius that holds every part (clip_factor 2) it is the mean within 1e-5.
    (A span has thousands of elements; in a few dimensions the distances to the median do not concentrate.)"""
    parts = honest_parts(seed, n, d, spread=0.1)
    weights = [1.0 + (i % 2) for i in range(n)]
    expected = weighted_mean(parts, weights)
    out = aggregate(parts, weights, CLIPPED)
    assert out.weights == weights
    assert float(torch.linalg.vector_norm(out.value - expected)) <= 0.025 * float(torch.linalg.vector_norm(expected))
    wide = aggregate(parts, weights, AggregationRule(clip_factor=2.0))
    assert torch.allclose(wide.value, expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(aggregate(parts, weights, MEAN).value, expected, rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), speeds=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=2, max_size=8))
def test_honest_peers_of_any_speed_keep_their_weight_where_their_speed_is_vouched_for(seed, speeds):
    """The clock schedule: a peer ``s`` times faster trains ``s`` times the tokens and steps, so its part is
    ``s * g + sqrt(s) * noise`` with weight ``s``. With caps from speeds the records vouch for, no weight or
    length is capped, and the rule is the plain token-weighted mean within 2% of its norm (the parts are
    rescaled to one length: a long one is no outlier); without, a peer more than weight_cap x faster than the
    group's lower median counts as weight_cap x in both (and the rule stays a combination of honest parts)."""
    g = torch.Generator().manual_seed(seed)
    d = 2048
    common = torch.randn(d, generator=g)
    parts = [s * common + math.sqrt(s) * 0.3 * torch.randn(d, generator=g) for s in speeds]
    weights = [float(s) for s in speeds]
    expected = weighted_mean(parts, weights)
    out = aggregate(parts, weights, CLIPPED, vouched_caps(weights, CLIPPED))
    assert out.weights == weights and min(out.lengths) == 1.0
    assert float(torch.linalg.vector_norm(out.value - expected)) <= 0.02 * float(torch.linalg.vector_norm(expected))
    unvouched = aggregate(parts, weights, CLIPPED)
    slowest = min(weights)
    assert all(u <= CLIPPED.weight_cap * max(slowest, float(lower_median(torch.tensor(weights)))) + 1e-9
               for u in unvouched.weights)
    assert float(torch.nn.functional.cosine_similarity(unvouched.value, expected, dim=0)) > 0.95


def test_vouched_caps_follow_the_records_speeds_within_the_rules_bounds():
    rule = AggregationRule(weight_cap=2.0, max_weight_cap=8.0)
    assert vouched_caps([100.0, 100.0, 400.0, None], rule) == [VOUCH_SLACK, VOUCH_SLACK, 4 * VOUCH_SLACK, None]
    assert vouched_caps([1.0, 1.0, 1e9], rule) == [VOUCH_SLACK, VOUCH_SLACK, 8.0]  # a steady liar: no more than 8
    assert vouched_caps([100.0, None, None], rule) == [None] * 3  # one known speed: nothing to compare with
    assert vouched_caps([0.0, 0.0, 50.0], rule) == [None] * 3
    # a vouched cap below the rule's own does not lower them
    out = aggregate([torch.ones(3), torch.ones(3), 2 * torch.ones(3)], [1.0, 1.0, 2.0], rule, [0.5, 0.5, None])
    assert out.weights == [1.0, 1.0, 2.0] and out.lengths == [1.0, 1.0, 1.25 / 2]
    with pytest.raises(ValueError):
        AggregationRule(weight_cap=4.0, max_weight_cap=2.0)
    with pytest.raises(ValueError):
        AggregationRule(length_cap=0.5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 8), d=st.integers(1, 128), perm_seed=st.integers(0, 1000),
       kind=st.sampled_from(ATTACKS))
def test_the_result_does_not_depend_on_the_order_of_the_parts(seed, n, d, perm_seed, kind):
    honest = honest_parts(seed, n - 1, d, spread=0.5)
    parts = honest + [attack(kind, honest, seed)]
    weights = [1.0 + (i % 4) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed)).tolist()
    a = aggregate(parts, weights, CLIPPED).value
    b = aggregate([parts[i] for i in order], [weights[i] for i in order], CLIPPED).value
    scale = 1.0 + float(torch.linalg.vector_norm(a))
    assert float(torch.linalg.vector_norm(a - b)) <= 1e-5 * scale
    # and bit for bit the same for the same order (every member decodes one encoding, but the reducer's
    # result must not depend on anything but its inputs)
    assert torch.equal(a, aggregate(parts, weights, CLIPPED).value)


def test_a_majority_on_one_point_is_the_answer_and_weights_and_lengths_are_capped_by_the_lower_median():
    same = torch.ones(5)
    out = aggregate([same, same.clone(), torch.full((5,), 1e6)], [1.0, 1.0, 1e9], CLIPPED)
    assert out.radius == 0.0 and out.weights == [1.0, 1.0, 2.0]
    # the third part points the same way: it counts with weight 2 and 1.25 times the median length, no more
    assert torch.allclose(out.value, same * (1 + 1 + 2 * 1.25) / (1 + 1 + 2))
    assert out.lengths[2] == pytest.approx(1.25e-6) and out.offending(2) and not out.offending(0)
    assert capped_weights([1.0, 2.0, 1e9], 4.0) == [1.0, 2.0, 8.0]
    assert capped_weights([1.0, 1e9], 4.0) == [1.0, 4.0]  # two peers: the larger counts 4x the smaller at most
    assert capped_weights([1.0, 1.0, 1e9, 1e9], [2.0, 2.0, 2.0, 8.0]) == [1.0, 1.0, 2.0, 8.0]  # one cap each
    assert float(lower_median(torch.tensor([3.0, 1.0, 2.0, 100.0]))) == 2.0
    zeros = aggregate([torch.zeros(3), torch.zeros(3), torch.ones(3)], [1.0, 1.0, 1.0], CLIPPED)
    assert torch.equal(zeros.value, torch.zeros(3))  # at least half the parts are zero


def test_two_contributors_cannot_be_told_apart_only_the_caps_apply():
    """Documented limit: with two parts each is 'the median', so the attacker's direction survives (bounded in
    weight and length); the member checks and the digest check are the defence there (peer/net/round/allreduce.py)."""
    h, a = torch.ones(4), torch.full((4,), -100.0)
    cap = CLIPPED.weight_cap
    out = aggregate([h, a], [1.0, 1e6], CLIPPED)
    assert out.weights == [1.0, cap]
    assert torch.allclose(out.value, (h + cap * (CLIPPED.length_cap * -h)) / (1 + cap))


def test_invalid_rules_and_inputs_are_refused():
    with pytest.raises(ValueError):
        AggregationRule(clip_factor=0.5)
    with pytest.raises(ValueError):
        AggregationRule(iterations=0)
    with pytest.raises(ValueError):
        aggregate([torch.ones(2)], [1.0, 2.0], CLIPPED)
    assert math.isinf(aggregate([torch.ones(2)], [1.0], MEAN).radius)


def test_of_two_parts_neither_is_an_offence_however_far_apart_but_both_are_capped():
    """With two contributors the lower median is the other part: the rule cannot tell which one is off (an honest
    peer that trained alone for long declares far more tokens and a far longer part than its partner), so it caps
    both and reports no offence; from three on, the odd one out is one."""
    short, long_ = torch.ones(6), torch.full((6,), 1e4)
    two = aggregate([short, long_], [1.0, 1e6], CLIPPED)
    assert two.weights == [1.0, 2.0] and two.lengths[1] < 1e-3  # capped: the result is bounded
    assert torch.allclose(two.value, short * (1 + 2 * 1.25) / (1 + 2))
    assert not two.offending(0) and not two.offending(1)
    three = aggregate([short, short.clone(), long_], [1.0, 1.0, 1e6], CLIPPED)
    assert three.offending(2) and not three.offending(0)


def test_the_medians_by_blocks_of_columns_are_those_of_the_whole_parts():
    """A span longer than a block of columns (the reducer's spans are millions long): the per-coordinate medians
    computed a block at a time are bit for bit those of one sort over every column."""
    g = torch.Generator().manual_seed(5)
    d = 3 * aggregate_module.COLUMNS + 17
    dense = torch.randn(5, d, generator=g)
    sparse = dense * (torch.rand(5, d, generator=g) < 0.3)
    for parts in (dense, dense[:4], sparse, sparse[:4]):
        assert torch.equal(coordinate_median(parts), aggregate_module._coordinate_median(parts))
        assert torch.equal(sender_median(parts), aggregate_module._sender_median(parts))
