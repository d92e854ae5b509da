"""The robust rule alone (peer/outer/aggregate.py) against one attacker in a group of 4, over its parameters.

Three honest outer gradients (a shared direction + 0.3 noise) and a 4th part declared with 10^6 times the
tokens: a x1000 copy of an honest part, a x10 sign flip of the honest mean, or x100 noise. Prints, per
(weight cap, length cap, CenterClip steps) and clip factor, ||result - honest mean|| / ||honest mean|| for
the three attacks, over one span of 333 elements (a group of 3 reducers of 1,000 elements). The farthest
honest part's distance is printed first: a result closer than it did less than an honest peer's own noise.
Run: ``python bench/rule_sweep.py`` (seconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer.outer.aggregate import AggregationRule, aggregate  # noqa: E402

SETTINGS = [(1, 1, 1), (2, 1.25, 1), (2, 1.25, 3), (2, 2, 1), (4, 1.25, 1), (4, 4, 3)]


def main() -> int:
    g = torch.Generator().manual_seed(3)
    common = torch.randn(1000, generator=g)
    honest = [common + 0.3 * torch.randn(1000, generator=g) for _ in range(3)]
    clean = sum(honest) / 3
    print(f"farthest honest part: {max(float((h - clean).norm() / clean.norm()) for h in honest):.3f}")
    attacks = {"x1000": 1000 * honest[0], "sign flip x10": -10 * clean,
               "noise x100": 100 * torch.randn(1000, generator=g)}
    span = slice(0, 333)
    print("| weight cap | length cap | steps | clip factor 1.0 | clip factor 2.0 |  (" + " / ".join(attacks) + ")")
    for weight_cap, length_cap, steps in SETTINGS:
        cells = []
        for clip_factor in (1.0, 2.0):
            rule = AggregationRule(weight_cap=weight_cap, length_cap=length_cap, iterations=steps,
                                   clip_factor=clip_factor, max_weight_cap=max(8, weight_cap, length_cap))
            errors = []
            for bad in attacks.values():
                out = aggregate([h[span] for h in honest] + [bad[span]], [1.0, 1.0, 1.0, 1e6], rule)
                errors.append(float((out.value - clean[span]).norm() / clean[span].norm()))
            cells.append(" / ".join(f"{e:.3f}" for e in errors))
        print(f"| {weight_cap} | {length_cap} | {steps} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
