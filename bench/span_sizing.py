"""One all-reduce with a slow uplink in the group: equal spans against spans that follow the declared links
(``swarm.span_sizing``, peer/net/round/group.py ``link_shares``), side by side in one run.

    .venv/bin/python bench/span_sizing.py [--members 4] [--fast-mbit 50] [--slow-mbit 1] [--numel 250000] [--reps 3]

Real p2p daemons on 127.0.0.1 and the real all-reduce (tests/test_allreduce.py's ``_run``, fp32): every member
declares its uplink; the last one's upload is held to ``--slow-mbit`` by its own pacer (the owner's upload cap), the
others are not capped (loopback). The two ways alternate ``--reps`` times. Prints each round's wall time (the
slowest member's), the spans, and the ratio of the medians. What to expect: the slow member sends its parts of
every other span and, as a reducer, its average to every other member; with equal spans that is
``(n - 1)/n + (n - 1)/n`` of the vector, with its span at 1/8 of the median's, about ``1 + (n - 2) x its span``.
A whole swarm's rounds also depend on when peers arrive (bench/uneven_links.py): this isolates the all-reduce.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import run_async  # noqa: E402
from peer.config import MBIT  # noqa: E402
from peer.outer.aggregate import AggregationRule, Aggregator  # noqa: E402
from test_allreduce import _run  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--fast-mbit", type=float, default=50.0)
    ap.add_argument("--slow-mbit", type=float, default=1.0)
    ap.add_argument("--numel", type=int, default=250_000, help="fp32 elements (1 MB at the default)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.members
    links = [args.fast_mbit * MBIT] * (n - 1) + [args.slow_mbit * MBIT]
    uploads = [0.0] * (n - 1) + [args.slow_mbit * MBIT]
    torch.manual_seed(0)
    deltas = [torch.randn(args.numel) for _ in range(n)]
    weights = [1.0] * n
    times: dict[str, list[float]] = {"equal": [], "links": []}
    spans: dict[str, list] = {}
    for _ in range(args.reps):
        for way in times:
            results, spans[way] = run_async(_run(n, list(range(n)), weights, deltas, part_timeout=120.0,
                                                 allreduce_timeout=240.0, numel=args.numel, uploads=uploads,
                                                 links=links, span_sizing=way,
                                                 rule=AggregationRule(kind=Aggregator.MEAN), chunk_bytes=65536))
            assert all(r.complete for r in results.values()), f"{way}: a round did not complete"
            times[way].append(max(r.seconds for r in results.values()))
    print(f"span sizing: {n} members, uplinks {args.fast_mbit:g} Mbit/s and one at {args.slow_mbit:g}, "
          f"{args.numel * 4 / 1e6:.1f} MB fp32, {platform.node()}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print("| spans | slow member's span | round wall time per rep (s) | median (s) |")
    print("| --- | --- | --- | --- |")
    for way, got in times.items():
        start, end = spans[way][-1]
        print(f"| {way} | {(end - start) / args.numel:.1%} of the vector | "
              f"{', '.join(f'{t:.1f}' for t in got)} | {statistics.median(got):.1f} |")
    print(f"links / equal: {statistics.median(times['links']) / statistics.median(times['equal']):.2f}x the round time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
