"""How much legitimate weight honest peers of unequal speed keep under the robust rule (issue 13).

On the clock schedule a peer's part carries the tokens it trained since its last round, so a GPU four times
faster than its group declares four times the weight, and its outer gradient (more inner steps from the
same start) is longer. The clipped rule caps each peer's weight and part length at its cap times the group's
lower median (``weight_cap``, or up to ``max_weight_cap`` where progress records vouch for its speed) and
clips the parts' directions, rescaled to one length, beyond ``clip_factor`` x the median distance.

Parts are modelled as ``steps * g + sqrt(steps) * noise`` (a shared descent direction plus the
random-walk part of SGD, with the noise-to-signal ratio ``--noise``), ``steps`` proportional to speed.
For each speed profile this prints, per peer, the share of its legitimate weight the clipped rule used
(weight used x length kept x deviation kept over its declared weight, relative to the plain token-weighted
mean's, where all three are whole: 1.0 = it kept all of it), and the cosine and length ratio between the
two results. Two cases: no peer vouched for (every cap ``weight_cap``) and every peer's speed vouched for
by its records (:func:`peer.outer.aggregate.vouched_caps`). Run: ``python bench/heterogeneity.py``.
"""

from __future__ import annotations

import argparse
import math

import torch

from peer.outer.aggregate import AggregationRule, Aggregator, aggregate, vouched_caps

PROFILES = {
    "equal x4": [1, 1, 1, 1],
    "one 2x": [1, 1, 1, 2],
    "one 4x": [1, 1, 1, 4],
    "one 8x": [1, 1, 1, 8],
    "1-2-4-8": [1, 2, 4, 8],
    "two 4x of 4": [1, 1, 4, 4],
    "pair 1-4": [1, 4],
    "eight, one 4x": [1, 1, 1, 1, 1, 1, 1, 4],
}


def shares(parts: list[torch.Tensor], weights: list[float], rule: AggregationRule,
           caps: list[float] | None = None) -> tuple[list[float], torch.Tensor]:
    """Each part's share of its legitimate weight the rule used (1.0 each for the mean), and the result."""
    agg = aggregate(parts, weights, rule, caps)
    return [u * n * k / w for u, n, k, w in zip(agg.weights, agg.lengths, agg.kept, weights)], agg.value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=65536)
    ap.add_argument("--noise", type=float, default=3.0, help="noise-to-signal ratio of one inner step's update")
    ap.add_argument("--steps", type=int, default=50, help="inner steps per round of the slowest peer")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--weight-cap", type=float, default=AggregationRule.weight_cap)
    ap.add_argument("--clip-factor", type=float, default=AggregationRule.clip_factor)
    args = ap.parse_args()
    clipped = AggregationRule(kind=Aggregator.CLIPPED, weight_cap=args.weight_cap, clip_factor=args.clip_factor)
    mean = AggregationRule(kind=Aggregator.MEAN)
    print(f"weight_cap {args.weight_cap}, clip_factor {args.clip_factor}, noise/signal {args.noise} per step, "
          f"{args.steps} steps per round on the slowest peer, {args.trials} trials")
    print(f"{'profile':<14} {'speeds':<26} {'vouched':<8} {'kept share per peer':<42} {'cos':>7} {'length':>7}")
    gen = torch.Generator().manual_seed(0)
    for name, speeds in PROFILES.items():
        for vouched in (False, True):
            caps = vouched_caps([float(x) for x in speeds], clipped) if vouched else None
            kept = torch.zeros(len(speeds), dtype=torch.float64)
            cos = length = 0.0
            gen.manual_seed(0)  # the same parts for both cases
            for _ in range(args.trials):
                g = torch.randn(args.numel, generator=gen) / math.sqrt(args.numel)
                steps = [s * args.steps for s in speeds]
                parts = [n * g + math.sqrt(n) * args.noise * torch.randn(args.numel, generator=gen)
                         / math.sqrt(args.numel) for n in steps]
                weights = [float(n) for n in steps]  # tokens ~ steps
                robust, value = shares(parts, weights, clipped, caps)
                _, reference = shares(parts, weights, mean)
                kept += torch.tensor(robust, dtype=torch.float64)
                cos += float(torch.nn.functional.cosine_similarity(value, reference, dim=0))
                length += float(value.norm() / reference.norm())
            kept /= args.trials
            print(f"{name:<14} {str(speeds):<26} {'yes' if vouched else 'no':<8} "
                  f"{' '.join(f'{k:.2f}' for k in kept.tolist()):<42} {cos / args.trials:>7.4f} "
                  f"{length / args.trials:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
