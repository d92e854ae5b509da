"""How a reducer combines its group's parts of one span: the plain weighted mean (trusted lab swarms) or a
robust rule that bounds what any one contributor can do to the result (volunteer swarms, the default).

The robust rule is BTARD's CenteredClip (Gorbunov et al. 2021, arXiv 2106.11257, the per-span rule of its
ButterflyClip; hivemind's ``CenteredClipAccumulator`` is the same idea), made deterministic and started from
a robust center:

1. weights: each declared weight (tokens) is capped at ``weight_cap`` times the *lower median* of the
   group's weights, so a peer that lies about its tokens gets at most ``weight_cap`` honest shares;
2. center ``v0``: the coordinate-wise median of the parts (with one arbitrary part among ``n >= 3``, every
   coordinate of it stays within the honest parts' range);
3. radius ``tau = clip_factor x`` the median of the parts' distances to ``v0`` (the upper one for even
   ``n``: fewer than half the parts cannot inflate it past ``clip_factor`` times the farthest honest part);
4. ``iterations`` times: ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i``, ``clip(u, tau) = u *
   min(1, tau / |u|)``.

Bound (tested in tests/test_aggregate.py): with ``v0``, ``tau`` and the weights fixed, the map of step 4
is non-expansive in the other parts' terms, so replacing contributor ``k``'s part by *anything* moves the
result by at most ``2 * iterations * tau * w_k / W`` (:func:`influence_bound`). Honest parts within ``tau``
of every iterate leave the plain weighted mean unchanged: where no part is clipped the rule *is* the mean
(after the cap). Two contributors cannot be told apart (each is "the median"): then only the weight cap
applies; members check what comes back, and the digest check catches a reducer that sends different
averages to different members.

Pure torch, deterministic for a given order of parts (the reducer passes them in member order, and every
member decodes the same encoded result). Memory: the parts of one span, ``n x span`` fp32 (one fragment
for a full group), plus a sort of the same size for the median.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from peer.config import OuterConfig


HEAVY_CLIP = 0.5  # a part of which the rule kept less than this fraction of its deviation is reported (logged)
# ... and less than this fraction counts as an offence (peer/net/exclusion.py): a part 10 radii from the center.
# Lower than HEAVY_CLIP because honest parts differ in size too (a slower peer's outer gradient is shorter):
# being reported now and then is harmless, being excluded is not.
OFFENCE_CLIP = 0.1
NORM_GUARD = 1e3  # parts are shortened to this many lower-median norms before anything else (see aggregate)
MAX_WEIGHT = 1e12  # the largest declared weight (tokens in one round) the protocol accepts


class Aggregator(enum.StrEnum):
    MEAN = "mean"  # plain token-weighted mean: every contributor is trusted
    CLIPPED = "clipped"  # weight cap + CenteredClip around the coordinate-wise median (module docstring)


@dataclass(frozen=True, kw_only=True)
class AggregationRule:
    """What a reducer does with the parts of its span (part of the run hash: every reducer of a run applies
    the same rule)."""

    kind: Aggregator = Aggregator.CLIPPED
    clip_factor: float = 1.0  # tau = clip_factor x the (upper) median of the parts' distances to the center; 1.0:
    # bench/attacks.py, 4 honest + 1 attacker: a x10 part +1.4% honest loss (excluded) vs +3.8% with 1.5, and no
    # cost without an attacker (the parts beyond the median distance are pulled in a little)
    weight_cap: float = 2.0  # a declared weight counts at most weight_cap x the lower median of the weights
    iterations: int = 1  # CenteredClip steps: one already gives the plain mean when nothing is clipped, and the
    # bound grows with each (tests/test_allreduce.py: a x1000 part moves the result 0.17 of its norm with 1
    # step and a cap of 2, 0.68 with 3 steps, a cap of 4 and clip_factor 2)

    def __post_init__(self) -> None:
        if self.clip_factor < 1 or self.weight_cap < 1 or not 1 <= self.iterations <= 20:
            raise ValueError(f"invalid aggregation rule {self}")

    @classmethod
    def from_config(cls, outer: OuterConfig) -> "AggregationRule":
        return cls(kind=Aggregator(outer.aggregator), clip_factor=outer.clip_factor, weight_cap=outer.weight_cap,
                   iterations=outer.clip_iterations)


@dataclass
class Aggregate:
    """The result of one span's aggregation, with what it did to each contributor (in the order given)."""

    value: torch.Tensor
    weights: list[float]  # the weights used (declared, capped)
    kept: list[float] = field(default_factory=list)  # per part, the fraction of its deviation kept in the last step
    radius: float = math.inf  # tau (inf for the plain mean)

    @property
    def total_weight(self) -> float:
        return sum(self.weights)


def lower_median(values: torch.Tensor) -> torch.Tensor:
    """The ``(n - 1) // 2``-th smallest value (with one arbitrary value among ``n >= 2``, it is at most the
    largest of the others)."""
    return values.sort().values[(values.numel() - 1) // 2]


def capped_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Each weight capped at ``cap`` times the lower median of all."""
    w = torch.tensor(weights, dtype=torch.float64)
    limit = cap * float(lower_median(w))
    return [min(x, limit) for x in weights]


def norm_guard(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` (n, d) with those longer than NORM_GUARD x the lower median norm shortened to it. A numeric guard,
    not the robust rule: no difference in :func:`aggregate` can then overflow fp32 (a finite part of 1e38s would
    turn into inf - inf)."""
    norms = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float64) for p in parts])
    limit = NORM_GUARD * float(lower_median(norms))
    return parts * torch.where(norms > limit, limit / norms.clamp_min(1e-300), 1.0).to(torch.float32)[:, None]


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``parts`` (n, d): the middle value, or the mean of the two middle ones."""
    n = parts.shape[0]
    ordered = parts.sort(dim=0).values
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, center: torch.Tensor, radius: float,
                  iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` CenteredClip steps from ``center`` with a fixed ``radius``; returns the result and, per
    part, the fraction of its deviation the last step kept (1 = not clipped)."""
    v = center.clone()
    w = weights.to(torch.float32)
    total = float(weights.sum())
    kept = torch.ones(parts.shape[0], dtype=torch.float32)
    for _ in range(iterations):
        dev = parts - v
        dist = torch.linalg.vector_norm(dev, dim=1)
        kept = torch.where(dist > radius, radius / dist.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
        v = v + ((w * kept) @ dev) / total
    return v, kept


def influence_bound(rule: AggregationRule, radius: float, weight: float, total_weight: float) -> float:
    """How far one contributor of weight ``weight`` (out of ``total_weight``) can move the clipped result, for
    a fixed center and radius, whatever its part: ``2 * iterations * radius * weight / total_weight``."""
    return 2 * rule.iterations * radius * weight / total_weight


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], rule: AggregationRule) -> Aggregate:
    """Combines ``parts`` (1-D fp32 tensors of one length, finite) declared with ``weights`` (finite, > 0)
    by ``rule``. Deterministic for a given order."""
    if not parts or len(parts) != len(weights):
        raise ValueError(f"{len(parts)} parts with {len(weights)} weights")
    stacked = torch.stack([p.to(torch.float32) for p in parts])
    if rule.kind is Aggregator.MEAN:
        w = torch.tensor(weights, dtype=torch.float64)
        value = ((w / w.sum()).to(torch.float32) @ stacked)
        return Aggregate(value, list(weights), [1.0] * len(parts))
    used = capped_weights(weights, rule.weight_cap)
    w = torch.tensor(used, dtype=torch.float64)
    stacked = norm_guard(stacked)
    center = coordinate_median(stacked)
    dist = torch.linalg.vector_norm(stacked - center, dim=1).sort().values
    radius = rule.clip_factor * float(dist[dist.numel() // 2])
    if radius == 0.0:  # at least half the parts sit on the center: it is the answer
        return Aggregate(center, used, [1.0] * len(parts), 0.0)
    value, kept = centered_clip(stacked, w, center, radius, rule.iterations)
    return Aggregate(value, used, kept.tolist(), radius)
