"""How a reducer combines its group's parts of one span (:func:`aggregate`): the plain weighted mean (trusted lab
swarms) or, by default, a robust rule that bounds what any one contributor can do to the result.

The robust rule is BTARD's CenteredClip (arXiv 2106.11257) made deterministic, started from a robust center and
applied to the parts' *directions*, so that honest peers of unequal speed are not clipped (docs/algorithm.md 4a):
each declared weight and part length is capped relative to the group's lower medians, the caps rising where
progress records vouch for a peer's speed (:func:`vouched_caps`); parts are rescaled to the lower median length;
the center is their coordinate-wise median (sparse parts: of the parts that send a coordinate, :func:`center_of`);
then ``iterations`` clip steps of radius ``clip_factor`` x the median distance. Where nothing is capped or
clipped the result is exactly the token-weighted mean, for peers of any speed.

Bound (tests/test_aggregate.py): replacing one contributor's part by anything moves the result by at most
:func:`influence_bound`. Two contributors cannot be told apart: then only the caps apply. Why the caps are what
they are, and what they still allow: docs/architecture.md, "Hostile peers". Pure torch, deterministic for a given
order of parts (member order); memory: one stacked copy of the parts and a few vectors of the span.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from peer.config import OuterConfig


COLUMNS = 1 << 15  # columns per block of the per-coordinate medians (by_columns)
HEAVY_CLIP = 0.5  # a part of which the rule kept less than this fraction of its deviation or length is reported
# ... and less than this fraction counts as an offence (peer/net/trust/exclusion.py): a part 10 radii from the center,
# or 10 caps longer than the group's median part. Lower than HEAVY_CLIP because honest parts differ too (a
# faster peer's outer gradient is longer): being reported now and then is harmless, being excluded is not.
OFFENCE_CLIP = 0.1
MAX_WEIGHT = 1e12  # the largest declared weight (tokens in one round) the protocol accepts
VOUCH_SLACK = 1.25  # a vouched peer's cap: this x its measured speed over the group's (round lengths vary)


class Aggregator(enum.StrEnum):
    MEAN = "mean"  # plain token-weighted mean: every contributor is trusted
    CLIPPED = "clipped"  # caps + CenteredClip of the directions around the coordinate-wise median (docstring)


@dataclass(frozen=True, kw_only=True)
class AggregationRule:
    """What a reducer does with the parts of its span (part of the run hash: every reducer of a run applies
    the same rule)."""

    kind: Aggregator = Aggregator.CLIPPED
    clip_factor: float = 1.0  # tau = clip_factor x the (upper) median of the parts' distances to the center; 1.0:
    # bench/attacks.py, 4 honest + 1 attacker: a x10 part +1.4% honest loss (excluded) vs +3.8% with 1.5, and no
    # cost without an attacker (the parts beyond the median distance are pulled in a little)
    weight_cap: float = 2.0  # a peer's weight counts at most weight_cap x the group's lower median
    length_cap: float = 1.25  # its part's length at most length_cap x the lower median length (parts of the same
    # steps differ by their noise only)
    max_weight_cap: float = 8.0  # both caps rise up to this where progress records vouch for its speed
    iterations: int = 1  # CenteredClip steps: one already gives the plain mean when nothing is clipped, and the
    # bound grows with each (tests/test_allreduce.py: a x1000 part moves the result 0.17 of its norm with 1
    # step and a cap of 2, 0.68 with 3 steps, a cap of 4 and clip_factor 2)

    def __post_init__(self) -> None:
        if (self.clip_factor < 1 or self.weight_cap < 1 or self.length_cap < 1
                or self.max_weight_cap < max(self.weight_cap, self.length_cap) or not 1 <= self.iterations <= 20):
            raise ValueError(f"invalid aggregation rule {self}")

    @classmethod
    def from_config(cls, outer: OuterConfig) -> "AggregationRule":
        return cls(kind=Aggregator(outer.aggregator), clip_factor=outer.clip_factor, weight_cap=outer.weight_cap,
                   length_cap=outer.length_cap, max_weight_cap=outer.max_weight_cap,
                   iterations=outer.clip_iterations)


@dataclass
class Aggregate:
    """The result of one span's aggregation, with what it did to each contributor (in the order given)."""

    value: torch.Tensor
    weights: list[float]  # the weights used (declared, capped)
    kept: list[float] = field(default_factory=list)  # per part, the fraction of its deviation kept in the last step
    radius: float = math.inf  # tau, in the rescaled parts' units (inf for the plain mean)
    lengths: list[float] = field(default_factory=list)  # per part, the fraction of its length kept by its cap
    strengths: list[float] = field(default_factory=list)  # per part, a_i = weight used x capped length ratio

    @property
    def total_weight(self) -> float:
        return sum(self.weights)

    def limited(self, i: int, declared: float) -> list[str]:
        """What the rule did to part ``i`` (declared with weight ``declared``) worth reporting; empty if nothing."""
        why = []
        if self.weights[i] < declared:
            why.append(f"declared weight {declared:.4g} capped to {self.weights[i]:.4g}")
        if self.lengths and self.lengths[i] < HEAVY_CLIP:
            why.append(f"part length capped to {self.lengths[i]:.1%} of itself")
        if self.kept[i] < HEAVY_CLIP:
            why.append(f"part clipped to {self.kept[i]:.1%} of its distance from the group's center")
        return why

    def offending(self, i: int) -> bool:
        """Part ``i`` was far off the group (an offence, peer/net/trust/exclusion.py): its direction 10 radii from the
        center, or its length 10 caps beyond the group's median. Never with fewer than three parts: of two, the
        lower median is the other part itself, so neither can be told to be the odd one (an honest peer that
        trained alone for long would be excluded by its only partner); the caps still bound both."""
        if len(self.weights) < 3:
            return False
        return self.kept[i] < OFFENCE_CLIP or bool(self.lengths) and self.lengths[i] < OFFENCE_CLIP


def lower_median(values: torch.Tensor) -> torch.Tensor:
    """The ``(n - 1) // 2``-th smallest value (with one arbitrary value among ``n >= 2``, it is at most the
    largest of the others)."""
    return values.sort().values[(values.numel() - 1) // 2]


def capped_weights(values: Sequence[float], caps: float | Sequence[float]) -> list[float]:
    """Each value capped at its cap (one for all, or one per value) times the lower median of all."""
    caps = [caps] * len(values) if isinstance(caps, (int, float)) else list(caps)
    base = float(lower_median(torch.tensor(values, dtype=torch.float64)))
    return [min(x, c * base) for x, c in zip(values, caps)]


def vouched_caps(rates: Sequence[Optional[float]], rule: AggregationRule) -> list[Optional[float]]:
    """Per member, the cap its speed earns (step 1 of the rule) as its progress records vouch for it (tokens/s;
    None where they do not, e.g. a newcomer): ``VOUCH_SLACK`` x its speed over the lower median of the known
    speeds, at most ``max_weight_cap``; None (the rule's own caps) without a vouched speed, or when fewer than
    two members' are known (nothing to compare with)."""
    known = torch.tensor([r for r in rates if r is not None and r > 0], dtype=torch.float64)
    if known.numel() < 2:
        return [None] * len(rates)
    base = float(lower_median(known))
    return [None if r is None or r <= 0 else min(rule.max_weight_cap, VOUCH_SLACK * r / base) for r in rates]


def by_columns(fn: Callable[[torch.Tensor], torch.Tensor], parts: torch.Tensor) -> torch.Tensor:
    """``fn(parts)`` for a per-coordinate ``fn`` ((n, c) -> (c,): each column's value depends on that column
    alone), computed on blocks of :data:`COLUMNS` columns: the same values, with the scratch of its sorts ``n x
    COLUMNS`` instead of ``n x d`` (a sort's values and int64 indices are three times the parts)."""
    d = parts.shape[1]
    if d <= COLUMNS:
        return fn(parts)
    out = torch.empty(d, dtype=parts.dtype, device=parts.device)
    for c0 in range(0, d, COLUMNS):
        out[c0:c0 + COLUMNS] = fn(parts[:, c0:c0 + COLUMNS])
    return out


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``parts`` (n, d): the middle value, or the mean of the two middle ones."""
    return by_columns(_coordinate_median, parts)


def _coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    n = parts.shape[0]
    ordered = parts.sort(dim=0).values
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def sender_median(parts: torch.Tensor) -> torch.Tensor:
    """The center for sparse parts (n, d), where the coordinate-wise median is zero almost everywhere: per
    coordinate, the median of the values of the parts that send it (nonzero), one zero joining an even count of
    them; zero where fewer than two send it. With one arbitrary part among ``n >= 3`` it lies within the other
    parts' range in every coordinate (a lone sender may be the attacker; a zero is in that range wherever one
    of them does not send the coordinate; the median of three lies between any two of them)."""
    return by_columns(_sender_median, parts)


def _sender_median(parts: torch.Tensor) -> torch.Tensor:
    sends = parts != 0
    count = sends.sum(dim=0)
    even = count % 2 == 0
    # non-senders sort last; equal values are equal bits, so the order among ties does not matter
    values = torch.cat([torch.where(sends, parts, math.inf), torch.where(even, 0.0, math.inf)[None]])
    middle = values.sort(dim=0).values.gather(0, ((count + even.to(count.dtype) - 1) // 2)[None])[0]
    return torch.where(count >= 2, middle, 0.0)


def nonzero_counts(parts: torch.Tensor) -> torch.Tensor:
    """Each part's (row's) number of nonzero entries, counted a block of :data:`COLUMNS` columns at a time
    (``count_nonzero`` over the whole of it makes an int64 copy of the parts)."""
    counts = torch.zeros(parts.shape[0], dtype=torch.int64, device=parts.device)
    for c0 in range(0, parts.shape[1], COLUMNS):
        counts += torch.count_nonzero(parts[:, c0:c0 + COLUMNS], dim=1)
    return counts


def center_of(directions: torch.Tensor) -> torch.Tensor:
    """Step 3's center: :func:`coordinate_median`, or :func:`sender_median` where at least half the parts have
    fewer than half their entries nonzero (a lower median of the parts' densities: of ``n >= 3``, one part cannot
    move it past all the others', so dense parts keep their center whatever one attacker sends)."""
    density = nonzero_counts(directions).to(torch.float64)
    sparse = 2 * float(lower_median(density)) < directions.shape[1]
    return sender_median(directions) if sparse else coordinate_median(directions)


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, center: torch.Tensor, radius: float,
                  iterations: int, *, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` CenteredClip steps from ``center`` with a fixed ``radius``; returns the result and, per
    part, the fraction of its deviation the last step kept (1 = not clipped). ``consume``: ``parts`` may be
    overwritten by the last step's deviations (the same values, without an ``n x d`` temporary)."""
    v = center.clone()
    w = weights.to(torch.float32)
    total = float(weights.sum())
    kept = torch.ones(parts.shape[0], dtype=torch.float32)
    for step in range(iterations):
        dev = parts.sub_(v) if consume and step == iterations - 1 else parts - v
        dist = torch.linalg.vector_norm(dev, dim=1)
        kept = torch.where(dist > radius, radius / dist.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
        v = v + ((w * kept) @ dev) / total
    return v, kept


def lengths_f64(parts: torch.Tensor) -> torch.Tensor:
    """Each part's (row's) Euclidean length in fp64, where a finite part of 1e38s has a finite length: the root of
    the sum of its blocks' squared fp64 lengths, blocks of :data:`COLUMNS` columns (an fp64 copy of a block at a
    time, not of the whole part)."""
    d = parts.shape[1]
    squares = torch.zeros(parts.shape[0], dtype=torch.float64, device=parts.device)
    for c0 in range(0, d, COLUMNS):
        squares += torch.linalg.vector_norm(parts[:, c0:c0 + COLUMNS], dim=1, dtype=torch.float64).square()
    return squares.sqrt()


def rescale(parts: torch.Tensor, caps: Sequence[float], *,
            in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: ``parts`` (n, d) rescaled to the lower median length ``M`` (zero parts stay zero; in ``parts``
    itself where ``in_place``, the same values), their length ratios ``|d_i| / M`` capped at ``caps``, and the
    fraction of each length its cap kept. ``M`` must be > 0. Norms in fp64: a finite part of 1e38s has a finite
    norm there."""
    norms = lengths_f64(parts)
    m = float(lower_median(norms))
    ratio = norms / m
    capped = torch.minimum(ratio, torch.tensor(caps, dtype=torch.float64))
    to_median = torch.where(norms > 0, m / norms.clamp_min(1e-300), 0.0)
    factors = to_median.to(torch.float32)[:, None]
    scaled = parts.mul_(factors) if in_place else parts * factors
    return scaled, capped, torch.where(ratio > 0, capped / ratio, 1.0)


def influence_bound(rule: AggregationRule, radius: float, strength: float, total_weight: float) -> float:
    """How far one contributor of strength ``strength`` (``a_k``; total weight used ``total_weight``) can move
    the clipped result, for a fixed center, radius and strengths, whatever its part:
    ``2 * iterations * radius * strength / total_weight``."""
    return 2 * rule.iterations * radius * strength / total_weight


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], rule: AggregationRule,
              caps: Optional[Sequence[Optional[float]]] = None) -> Aggregate:
    """Combines ``parts`` (1-D fp32 tensors of one length, finite) declared with ``weights`` (finite, > 0)
    by ``rule``; ``caps``: per part, the cap its vouched speed earns (:func:`vouched_caps`; None: the rule's
    ``weight_cap`` and ``length_cap``). Deterministic for a given order."""
    if not parts or len(parts) != len(weights) or (caps is not None and len(caps) != len(parts)):
        raise ValueError(f"{len(parts)} parts with {len(weights)} weights")
    n = len(parts)
    stacked = torch.stack([p.to(torch.float32) for p in parts])
    if rule.kind is Aggregator.MEAN:
        w = torch.tensor(weights, dtype=torch.float64)
        value = ((w / w.sum()).to(torch.float32) @ stacked)
        return Aggregate(value, list(weights), [1.0] * n, lengths=[1.0] * n, strengths=list(weights))
    earned = list(caps) if caps is not None else [None] * n
    used = capped_weights(weights, [max(rule.weight_cap, c or 0.0) for c in earned])
    norms = lengths_f64(stacked)
    if float(lower_median(norms)) == 0.0:  # at least half the parts are zero: so is the answer
        return Aggregate(torch.zeros_like(stacked[0]), used, [1.0] * n, 0.0, [1.0] * n, [0.0] * n)
    # (the stacked copy is ours: rescaled where it is)
    directions, ratios, lengths = rescale(stacked, [max(rule.length_cap, c or 0.0) for c in earned], in_place=True)
    strength = torch.tensor(used, dtype=torch.float64) * ratios
    center = center_of(directions)
    # (row by row: the values of one norm over dim 1, without an n x d temporary)
    dist = torch.stack([torch.linalg.vector_norm(row - center) for row in directions]).sort().values
    radius = rule.clip_factor * float(dist[dist.numel() // 2])
    if radius == 0.0:  # at least half the directions sit on the center: it is the answer
        value, kept = center, torch.ones(n)
    else:
        value, kept = centered_clip(directions, strength, center, radius, rule.iterations, consume=True)
    value = value * float(strength.sum() / sum(used))
    return Aggregate(value, used, kept.tolist(), radius, lengths.tolist(), strength.tolist())
