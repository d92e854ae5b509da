"""Attacks on the outer aggregation, in the simulator: honest peers' final loss with one attacker among 4
honest peers (or two among 8), for the plain mean and the robust rule, against clean runs in the same
invocation.

    .venv/bin/python bench/attacks.py                           # 4 honest + 1 attacker: ~6 min on 2 cores
    .venv/bin/python bench/attacks.py --honest 8 --attackers 2  # ~15 min
    .venv/bin/python bench/attacks.py --attacks scale1000,weight_lie --rules clipped
    .venv/bin/python bench/attacks.py --codec topk32 --rules clipped   # a sparse codec (with error feedback)

Each run trains bench/quality.py's full method (FP4 e3m0, tau 5, replay merge, eager; tiny preset on the
synthetic Markov corpus, ``--quick`` length: 6 rounds of H = 16) in the simulator
(:class:`peer.outer.simulator.FakeTransport`), the attackers being the last replicas: each tampers with the
outer gradient it sends (and the weight it declares) every round. The transport plays the honest reducers:
the rule combines the parts (``mean``, or ``clipped``, the swarm's default: peer/outer/aggregate.py),
non-finite parts are refused, and with ``clipped`` a replica with 3 offences (refused parts, parts the rule
cut to less than a tenth) is excluded, as the swarm's peers do (peer/net/trust/exclusion.py). The whole vector is one
span here (the swarm cuts it into one span per reducer).

Not here (they need the swarm's processes): a lying reducer, a member that breaks every round, forged
progress records and a forged state donor: bench/swarm_attacks.py runs them in loopback swarms.

Prints one table (and writes ``--out``, JSON): per attack and rule, the honest replicas' final eval CE, its
change against the clean run with the same rule, and the round at which the attackers were excluded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from quality import BY_KEY, SPARSE_OUTER, RunResult, Setup, run_one  # noqa: E402

from peer.outer.codec import SPARSE_CODECS, get_codec  # noqa: E402


def _noise(delta: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(int(delta.numel()))
    noise = torch.randn(delta.shape, generator=g)
    return noise * (10 * float(delta.norm()) / float(noise.norm())), weight


def _nonfinite(delta: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
    out = delta.clone()
    out[::7] = float("nan")
    return out, weight


def _camouflage(delta: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
    """Against the sender median (peer/outer/aggregate.py): its own outer gradient, its largest 1/512 entries (a
    quarter of what topk32 sends, the ones most likely sent by other peers too: the center) kept, the rest of
    what it sends negated. Its support and length are an honest part's; it stays near the center where the
    center is not zero."""
    flat = delta.abs().flatten()
    keep = max(1, flat.numel() // 512)
    threshold = flat.kthvalue(flat.numel() - keep + 1).values
    return torch.where(delta.abs() >= threshold, delta, -delta), weight


ATTACKS = {  # what an attacker does to (its outer gradient, its declared weight) every round
    "clean": None,
    "scale10": lambda d, w: (10 * d, w),
    "scale1000": lambda d, w: (1000 * d, w),
    "weight_lie": lambda d, w: (d, 1e6 * w),
    "scale1000_weight_lie": lambda d, w: (1000 * d, 1e6 * w),  # the first attack
    "noise": _noise,  # random direction, 10x the norm of its real outer gradient
    "sign_flip": lambda d, w: (-d, w),
    "nonfinite": _nonfinite,
    "camouflage": _camouflage,  # adaptive, against the sender median of sparse parts
}
RULES = {"mean": "full", "clipped": "full_clipped"}  # bench/quality.py's methods: the full method, each rule


def method_of(rule: str, codec: str):
    """The rule's full method of bench/quality.py, with ``codec`` on the wire where given (a sparse codec with the
    error feedback it requires and the outer optimizer it wants, SPARSE_OUTER)."""
    method = BY_KEY[RULES[rule]]
    if not codec or codec == method.codec:
        return method
    sparse = SPARSE_OUTER if codec in SPARSE_CODECS else {}
    return dataclasses.replace(method, key=f"{method.key}_{codec}", codec=codec,
                               error_feedback=method.error_feedback or codec in SPARSE_CODECS, **sparse)


def run_job(job: tuple[str, str, dict, int, int, str]) -> tuple[str, str, RunResult]:
    attack, rule, setup, attackers, seed, codec = job
    setup = Setup(**setup)
    fn = ATTACKS[attack]
    tamper = {} if fn is None else {setup.replicas - 1 - k: fn for k in range(attackers)}
    return attack, rule, run_one(method_of(rule, codec), setup, seed, tamper=tamper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int, default=4)
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--attacks", default=",".join(a for a in ATTACKS if a != "clean"))
    ap.add_argument("--rules", default="mean,clipped")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip-factor", type=float, default=Setup.clip_factor, help="of the clipped rule")
    ap.add_argument("--weight-cap", type=float, default=Setup.weight_cap, help="of the clipped rule")
    ap.add_argument("--clip-iterations", type=int, default=Setup.clip_iterations, help="of the clipped rule")
    ap.add_argument("--codec", default="", help="the wire codec (default: the full method's, FP4 e3m0); a sparse "
                    "one (topk32, ...) with error feedback")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "runs/bench_attacks/results.json")
    args = ap.parse_args()
    attacks = ["clean"] + [a for a in args.attacks.split(",") if a and a != "clean"]
    rules = [r for r in args.rules.split(",") if r]
    for name in attacks:
        if name not in ATTACKS:
            ap.error(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    for rule in rules:
        if rule not in RULES:
            ap.error(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
    if args.codec:
        try:
            get_codec(args.codec)
        except ValueError:
            ap.error(f"unknown codec {args.codec!r}")
    setup = Setup(replicas=args.honest + args.attackers, H=16, rounds=6, clip_factor=args.clip_factor,
                  weight_cap=args.weight_cap, clip_iterations=args.clip_iterations)
    jobs = [(a, r, dataclasses.asdict(setup), args.attackers, args.seed, args.codec) for a in attacks for r in rules]
    print(f"{len(jobs)} runs: {args.honest} honest + {args.attackers} attacker(s), codec "
          f"{method_of(rules[0], args.codec).codec}, rules {rules} (clipped: "
          f"clip factor {setup.clip_factor}, weight cap {setup.weight_cap}, {setup.clip_iterations} step(s)), "
          f"{setup.steps} steps each, {args.jobs} jobs", flush=True)
    t0 = time.perf_counter()
    results: dict[tuple[str, str], RunResult] = {}
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        for fut in as_completed([pool.submit(run_job, job) for job in jobs]):
            attack, rule, res = fut.result()
            results[(attack, rule)] = res
            print(f"  [{len(results):2d}/{len(jobs)}] {attack:22s} {rule:8s} honest CE {res.final_honest:.4f} "
                  f"({res.seconds:.0f} s; {time.perf_counter() - t0:.0f} s elapsed)", flush=True)

    rows = []
    print("\n| attack | rule | honest final CE | vs clean, same rule | attackers excluded at round |")
    print("| --- | --- | --- | --- | --- |")
    for attack in attacks:
        for rule in rules:
            res, clean = results[(attack, rule)], results[("clean", rule)]
            change = res.final_honest / clean.final_honest - 1
            excluded = ", ".join(str(r) for _, r in sorted(res.excluded.items())) or "-"
            finite = "" if res.finite else " (NOT FINITE)"
            print(f"| {attack} | {rule} | {res.final_honest:.4f}{finite} | {change:+.2%} | {excluded} |")
            rows.append(dict(attack=attack, rule=rule, honest_ce=res.final_honest, change=change,
                             excluded=res.excluded, finite=res.finite))
    if "mean" in rules and "clipped" in rules:
        cost = results[("clean", "clipped")].final_honest / results[("clean", "mean")].final_honest - 1
        print(f"\nthe robust rule with no attacker: {cost:+.2%} honest CE against the plain mean")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), machine=platform.platform(),
                                        honest=args.honest, attackers=args.attackers, seed=args.seed,
                                        codec=method_of(rules[0], args.codec).codec,
                                        setup=dataclasses.asdict(setup), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
