"""One digest for every applied round, in a loopback swarm of many peers (issue 27's invariant at size).

    .venv/bin/python bench/agreement.py [--peers 16] [--steps 150] [--out-dir runs/bench_agreement]

Starts a bootstrap node and ``--peers`` peers on 127.0.0.1 (demo.toml, tiny preset, the steps schedule, the
fast settings of ``tests/test_swarm.py``), lets them train ``--steps`` steps, and checks every round: all the
peers that applied it hold one digest after it (no filter). Prints, per fragment, the rounds, how many peers
applied each, the groups' sizes and the statuses (``off_base``: contributed without applying; ``minority``: a
group too small to apply). Exit 0 only if the invariant held. Every process started is killed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import applied_digests, events  # noqa: E402
from test_swarm import start_bootstrap, start_peer, wait_exit  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the peers to finish")
    ap.add_argument("--out-dir", default="runs/bench_agreement")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    procs: list = []
    names = [f"p{i}" for i in range(args.peers)]
    try:
        initial = start_bootstrap(procs, out)
        peers = [start_peer(procs, out, n, initial, args.steps, "--min-peers", str(args.peers),
                            "--start-timeout", "600") for n in names]
        codes = {n: wait_exit(p, args.timeout) for n, p in zip(names, peers)}
    finally:
        for p in procs:
            p.kill_group()
    applied = applied_digests(out, names)
    statuses = Counter(e["status"] for n in names for e in events(out, n, "round"))
    off = {k: Counter(v.values()) for k, v in sorted(applied.items()) if len(set(v.values())) > 1}
    print(f"{args.peers} peers, {args.steps} steps; exit codes {Counter(codes.values())}; statuses {dict(statuses)}")
    for key, digests in sorted(applied.items()):
        sizes = Counter(e["group_size"] for n in names for e in events(out, n, "round")
                        if (e["fragment"], e["round"]) == key)
        print(f"  fragment {key[0]} round {key[1]:3d}: applied by {len(digests):2d}, "
              f"{len(set(digests.values()))} digest(s), group sizes {dict(sizes)}")
    print("invariant held: every applier of every round holds one digest" if not off else f"VIOLATED: {off}")
    return 0 if not off and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
