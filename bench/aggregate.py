"""A reducer's combination of its span (``peer.outer.aggregate.aggregate``, the robust rule): time and the peak
host memory it adds beyond the parts, for a few group sizes and span lengths.

    .venv/bin/python bench/aggregate.py [--cases 4x4000000,2x13000000,8x2000000] [--density 1.0,0.01]

Each case runs in a child process: ``n`` parts of ``L`` fp32 elements (a common direction plus each member's
noise; ``density`` < 1 keeps that fraction of entries, as a sparse codec's parts), the rule once on a small slice
to warm up, then once on the whole parts, timed; the peak is ``ru_maxrss`` after it less before it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(n: int, length: int, density: float) -> dict:
    import torch

    from peer.outer.aggregate import AggregationRule, aggregate

    g = torch.Generator().manual_seed(0)
    common = torch.randn(length, generator=g)
    parts = []
    for _ in range(n):
        p = common + 0.5 * torch.randn(length, generator=g)
        if density < 1:
            p.mul_(torch.rand(length, generator=g) < density)
        parts.append(p)
    rule = AggregationRule()
    aggregate([p[:100_000] for p in parts], [1.0] * n, rule)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    aggregate(parts, [1.0 + i % 3 for i in range(n)], rule)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"n": n, "length": length, "density": density, "seconds": seconds, "peak_bytes": peak * 1024,
            "parts_bytes": 4 * n * length}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="4x4000000,2x13000000,8x2000000")
    ap.add_argument("--density", default="1.0,0.01")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: n,length,density in this process
    args = ap.parse_args(argv)
    if args.one:
        n, length, density = args.one.split(",")
        print(json.dumps(one(int(n), int(length), float(density))))
        return 0
    print("| parts x length | density | seconds | peak beyond the parts | the parts |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        n, length = case.split("x")
        for density in args.density.split(","):
            done = subprocess.run([sys.executable, __file__, "--one", f"{n},{length},{density}"], capture_output=True,
                                  text=True, timeout=600, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {n} x {length} | {density} | {r['seconds']:.3f} | {r['peak_bytes'] / 2**30:.2f} GiB "
                  f"| {r['parts_bytes'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
