"""Discrete-event simulation of swarmloco's rounds at 16 to 1000 peers (issue 16): today's flat butterfly against
the bounded multi-level design, at 0/1/5% peer failure per round, on fixed 100 Mbit/s and home-broadband links.

    .venv/bin/python bench/scale_sim.py                      # everything below, ~2 min on this machine
    .venv/bin/python bench/scale_sim.py --quick              # fewer rounds and sizes
    .venv/bin/python bench/scale_sim.py --sizes 16,64 --fails 0.01 --links home

Prints a markdown table per link kind, the largest size at >= 95% utilization per design and failure rate, writes
the summaries as JSON (``--out``) and the plots (``--plots``, docs/images/scale-*.png). Deterministic for a seed.
The model, its calibration and what it leaves out: bench/scale/ and docs/benchmarks.md ("Scale").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from scale.calibration import Workload  # noqa: E402
from scale.report import largest_at, plots, table  # noqa: E402
from scale.runner import Config, simulate  # noqa: E402


def rounds_for(peers: int, quick: bool) -> int:
    rounds = 24 if peers <= 32 else 16 if peers <= 128 else 8 if peers <= 256 else 6
    return max(3, rounds // 3) if quick else rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256,1000")
    ap.add_argument("--sweep", default="32,128,512", help="extra sizes, failure-free on fixed links only (the curve)")
    ap.add_argument("--fails", default="0,0.01,0.05")
    ap.add_argument("--links", default="fixed:100,home", help="fixed:<Mbit/s> and/or home; home runs at p > 0 only")
    ap.add_argument("--designs", default="flat,bounded")
    ap.add_argument("--cap", type=int, default=8, help="bounded: group cap")
    ap.add_argument("--cutoff", type=float, default=5.0, help="bounded: seconds after a slot's start to the plan")
    ap.add_argument("--holder-min-mbit", type=float, default=10.0, help="bounded: slower uplinks hold no slot")
    ap.add_argument("--step-s", type=float, default=Workload.step_s)
    ap.add_argument("--tau", type=int, default=Workload.tau_steps)
    ap.add_argument("--params", type=float, default=Workload.params)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="runs/bench_scale/results.json")
    ap.add_argument("--plots", default="docs/images", help="folder for scale-*.png ('' for none)")
    args = ap.parse_args(argv)
    wl = Workload(step_s=args.step_s, tau_steps=args.tau, params=args.params)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    sweep = [int(s) for s in args.sweep.split(",") if s] if not args.quick else []
    fails = [float(f) for f in args.fails.split(",") if f]
    designs = [d for d in args.designs.split(",") if d]
    link_kinds = [k for k in args.links.split(",") if k]
    configs = []
    for links in link_kinds:
        for p in fails:
            if links == "home" and p == 0:
                continue
            extra = sweep if (p == 0 and links != "home") else []
            for peers in sorted(set(sizes + extra)):
                for design in designs:
                    configs.append(Config(design=design, peers=peers, p_fail=p, links=links,
                                          rounds=rounds_for(peers, args.quick), seed=args.seed, cap=args.cap,
                                          cutoff=args.cutoff, holder_min_mbit=args.holder_min_mbit))
    print(f"workload: {wl.params / 1e6:.0f}M params in {wl.fragments} fragments of {wl.fragment_elems / 1e6:.1f}M "
          f"({wl.codec}), a fragment round every {wl.slot_s:.0f} s, step {wl.step_s} s, tau {wl.tau_steps} steps "
          f"({wl.tau_s:.0f} s); {len(configs)} configurations")
    rows, started = [], time.perf_counter()
    for cfg in configs:
        t = time.perf_counter()
        rows.append(simulate(cfg, wl))
        print(f"  {cfg.links:9} p={cfg.p_fail:<5} {cfg.design:8} {cfg.peers:5} peers  {cfg.rounds:2} rounds "
              f"{time.perf_counter() - t:5.1f} s", flush=True)
    print(f"simulated in {time.perf_counter() - started:.0f} s\n")
    for links in link_kinds:
        print(f"### {links}\n")
        print(table([r for r in rows if r["links"] == links and r["peers"] in sizes]) + "\n")
    print("largest size at >= 95% utilization (every smaller size too; 0: none):")
    for links in link_kinds:
        for p in fails:
            for design in designs:
                if links == "home" and p == 0:
                    continue
                print(f"  {links:9} p={p:<5} {design:8} {largest_at(rows, design, p, links)}")
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": repr(wl), "rows": rows}, indent=1))
    if args.plots:
        for path in plots(rows, REPO / args.plots):
            print(f"plot: {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
