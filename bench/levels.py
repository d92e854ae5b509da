"""Bounded groups with real peers: 16 peer processes on 127.0.0.1 in two levels (``--group-cap 4``) and, side by
side in the same invocation, the same swarm in one group (``--group-cap 0``).

    .venv/bin/python bench/levels.py [--peers 16] [--cap 4] [--steps 60] [--out-dir runs/bench_levels]

Settings of ``tests/test_levels_swarm.py`` (tiny preset, seq 16 x batch 4, H = 20, each peer training a quarter
of the time). Per design: rounds launched, rounds every peer applied with one digest, the median round
time (launch to outcome), the median group size, the median bytes each peer sent per round, the total weight
(tokens) of each agreed round (every peer's contribution is in it when it is the sum of all peers' tokens), the
rounds whose appliers hold different digests (the invariant: none) and the number of distinct final states.
Logs stay in ``--out-dir`` (cleared at start). Every process started is killed at the end, also on errors and
Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import applied_digests, final_digests  # noqa: E402
from test_levels_swarm import agreed_rounds, run_swarm  # noqa: E402


def kill_all(procs: list) -> None:
    for proc in procs:
        if proc.returncode is None or proc.session_pids():
            proc.kill_group(signal.SIGKILL)


def row(label: str, rounds: dict, run_dir: Path) -> str:
    applied = applied_digests(run_dir, list(rounds))  # the invariant: every applier of a round, one digest
    split = sorted(k for k, v in applied.items() if len(set(v.values())) > 1)
    finals = {json.dumps(final_digests(run_dir, n), sort_keys=True) for n in rounds}
    agreed = agreed_rounds(rounds)
    launched = set().union(*rounds.values())
    outcomes = [e for r in rounds.values() for e in r.values()]
    ok = [e for e in outcomes if e["status"] == "ok"]
    first = next(iter(rounds.values()))
    totals = [first[k]["total_weight"] for k in agreed]  # the same on every peer (one digest, one result)
    return (f"| {label} | {len(launched)} | {len(agreed)} | "
            f"{statistics.median(e['seconds'] for e in ok):.1f} | "
            f"{statistics.median(e['group_size'] for e in ok):.0f} | "
            f"{statistics.median(e['bytes_sent'] for e in ok) / 1e6:.2f} | "
            f"{', '.join(f'{w:.0f}' for w in totals) or '-'} | {len(split)} {split or ''} | {len(finals)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--cap", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out-dir", default="runs/bench_levels")
    args = ap.parse_args()
    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    for label, cap in ((f"two levels, cap {args.cap}", args.cap), ("one group", 0)):
        procs: list = []
        run_dir = out / f"cap{cap}"
        run_dir.mkdir(parents=True)
        try:
            rows.append(row(label, run_swarm(procs, run_dir, args.peers, cap, args.steps, timeout=1200), run_dir))
        except AssertionError as e:  # a peer that did not exit: say so, and go on with the other design
            rows.append(f"| {label} | failed: {str(e).splitlines()[0]} |")
        finally:
            kill_all(procs)
        print(rows[-1], flush=True)
    print(f"\n{args.peers} peers, {args.steps} steps each\n")
    print("| design | rounds launched | agreed by all (one digest) | median round s | median group | "
          "median MB sent per peer and round | total weight of each agreed round | rounds whose appliers hold "
          "different digests | final states |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
