"""How much legitimate weight honest peers of unequal speed keep under the robust rule (issue 13).

On the clock schedule a peer's part carries the tokens it trained since its last round, so a GPU four times
faster than its group declares four times the weight, and its outer gradient (more inner steps from the
same start) is longer. The clipped rule caps weights at ``weight_cap`` x the group's lower median and pulls
parts beyond ``clip_factor`` x the median distance toward the center: both can cost an honest fast peer.

Parts are modelled as ``steps * g + sqrt(steps) * noise`` (a shared descent direction plus the
random-walk part of SGD, with the noise-to-signal ratio ``--noise``), ``steps`` proportional to speed.
For each speed profile this prints, per peer, its share of the result under the clipped rule divided
by its share under the plain token-weighted mean (1.0 = it kept all its legitimate weight), and the
cosine between the two results. Run: ``python bench/heterogeneity.py``.
"""

from __future__ import annotations

import argparse
import math

import torch

from peer.outer.aggregate import AggregationRule, Aggregator, aggregate

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


def shares(parts: list[torch.Tensor], weights: list[float], rule: AggregationRule) -> tuple[list[float], torch.Tensor]:
    """Each part's share of the result: its weight used times the fraction of its deviation kept, normalized
    (for the mean: its declared weight's fraction)."""
    agg = aggregate(parts, weights, rule)
    eff = [w * k for w, k in zip(agg.weights, agg.kept)]
    total = sum(agg.weights)
    return [e / total for e in eff], agg.value


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
    print(f"{'profile':<16} {'speeds':<26} {'kept share per peer (clipped / mean)':<48} {'cos(result)':>11}")
    gen = torch.Generator().manual_seed(0)
    for name, speeds in PROFILES.items():
        kept = torch.zeros(len(speeds), dtype=torch.float64)
        cos = 0.0
        for _ in range(args.trials):
            g = torch.randn(args.numel, generator=gen) / math.sqrt(args.numel)
            steps = [s * args.steps for s in speeds]
            parts = [n * g + math.sqrt(n) * args.noise * torch.randn(args.numel, generator=gen) / math.sqrt(args.numel)
                     for n in steps]
            weights = [float(n) for n in steps]  # tokens ~ steps
            robust, value = shares(parts, weights, clipped)
            plain, reference = shares(parts, weights, mean)
            kept += torch.tensor([r / p for r, p in zip(robust, plain)], dtype=torch.float64)
            cos += float(torch.nn.functional.cosine_similarity(value, reference, dim=0))
        kept /= args.trials
        print(f"{name:<16} {str(speeds):<26} {' '.join(f'{k:.2f}' for k in kept.tolist()):<48} "
              f"{cos / args.trials:>11.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
