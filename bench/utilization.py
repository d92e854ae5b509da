"""Compute utilization of peers on a shaped link: blocking DiLoCo vs. the full method, in one invocation.

    sudo .venv/bin/python bench/utilization.py [--rate-mbit 50] [--steps 300] [--preset tiny] [--peers 4]
                                               [--sync-every 50] [--tau 20|auto] [--seq-len 32] [--batch-size 4]

Builds a network lab (``tests/netns.py``: Linux network namespaces on a private bridge, 10.77.0.0/24,
nothing routed outside it), puts a bootstrap node in host 0 and ``--peers`` peers in hosts 1..N, and
limits every peer's link to ``--rate-mbit`` in each direction (tc tbf). Then it trains the same model
twice, one method after the other, each in a fresh lab:

- ``blocking``: DiLoCo -- the whole model in one fragment, fp32 on the wire, tau = 0 (every H steps the
  peer stops and waits for the all-reduce: ``--outer-fragment-blocks 0 --outer-codec fp32 --outer-tau 0``);
- ``streaming``: the full method -- fragments of k blocks, FP4 (e3m0, or ``--codec``) on the wire, overlap tau
  and eager updates (``--outer-fragment-blocks K --outer-codec e3m0 --outer-tau TAU --outer-eager``).

Per peer it reads the last JSON ``step`` event: ``compute_seconds`` (time in inner steps) and
``blocked_seconds`` (time the trainer waited for aggregates), and reports

- utilization = compute / (compute + blocked)  (the trainer's own accounting), and
- wall utilization = compute / elapsed          (elapsed = training wall time up to the last step: also
  charges every other stall of the training thread, e.g. launching a round, merging, DHT lookups).

If a trainer does not log ``compute_seconds``/``blocked_seconds``, the script falls back to wall time
(compute = steps x the mean step time of windows without rounds) and says so. Needs root (network
namespaces). Every process and namespace it starts is removed at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import Proc  # noqa: E402
from netns import NetnsLab, netns_available, start_lab_swarm  # noqa: E402

POLL = 0.2


@dataclass
class Method:
    name: str
    flags: list[str]
    describe: str


@dataclass
class PeerResult:
    name: str
    exit_code: int | None
    steps: int = 0
    compute: float = 0.0
    blocked: float = 0.0
    elapsed: float = 0.0
    rounds: dict[str, int] = field(default_factory=dict)
    bytes_sent: list[int] = field(default_factory=list)
    fragment_bytes: dict[int, list[int]] = field(default_factory=dict)
    round_seconds: list[float] = field(default_factory=list)
    loop: dict[str, float] = field(default_factory=dict)  # the training loop's seconds by part (loop_seconds)
    fallback: bool = False

    @property
    def utilization(self) -> float:
        return self.compute / max(self.compute + self.blocked, 1e-9)

    @property
    def wall_utilization(self) -> float:
        return self.compute / max(self.elapsed, 1e-9)


def methods(args) -> list[Method]:
    return [
        Method("blocking", ["--outer-fragment-blocks", "0", "--outer-codec", "fp32", "--outer-tau", "0"],
               "DiLoCo: 1 fragment, fp32, tau 0"),
        Method("streaming", ["--outer-fragment-blocks", str(args.fragment_blocks), "--outer-codec", args.codec,
                             "--outer-tau", str(args.tau), "--outer-tau-max", str(args.tau_max), "--outer-eager",
                             *(["--outer-error-feedback"] if args.codec.startswith("topk") else [])],
               f"k={args.fragment_blocks} blocks/fragment, {args.codec}, tau {args.tau}, eager"),
    ]


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def peer_result(name: str, proc: Proc, run_dir: Path) -> PeerResult:
    ev = read_events(run_dir / "events.jsonl")
    res = PeerResult(name, proc.returncode)
    steps = [e for e in ev if e["event"] == "step"]
    if steps:
        last = steps[-1]
        res.steps, res.elapsed = last["step"], last["elapsed"]
        res.loop = last.get("loop_seconds", {})
        if "compute_seconds" in last and "blocked_seconds" in last:
            res.compute, res.blocked = last["compute_seconds"], last["blocked_seconds"]
        else:  # an older trainer: step time from the 10-step windows without a launch or an apply in them
            res.fallback = True
            busy = {s for e in ev if e["event"] == "round" for s in (e["step"], e.get("launch_step", e["step"]))}
            per_step = [(b["elapsed"] - a["elapsed"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:])
                        if not any(a["step"] <= s < b["step"] for s in busy)]
            compute = statistics.mean(per_step) * res.steps if per_step else res.elapsed
            res.compute, res.blocked = min(compute, res.elapsed), max(0.0, res.elapsed - compute)
    for e in ev:
        if e["event"] == "round":
            res.rounds[e["status"]] = res.rounds.get(e["status"], 0) + 1
            if e["status"] == "ok":
                res.bytes_sent.append(e["bytes_sent"])
                res.fragment_bytes.setdefault(e["fragment"], []).append(e["bytes_sent"])
                res.round_seconds.append(e["seconds"])
    return res


def print_loop_parts(rows) -> None:
    """Where the training loop's wall time went, per method: each part's seconds per peer (mean over the peers) and
    its share of the training time; ``step`` is the inner steps (what utilization calls compute), ``apply`` includes
    the waits for aggregates (``blocked``)."""
    parts = sorted({k for *_, results in rows for r in results for k in r.loop})
    if not parts:
        return
    print("\n| method | " + " | ".join(parts) + " |  (seconds per peer, share of the training time)")
    print("|---|" + "---:|" * len(parts))
    for method, *_, results in rows:
        elapsed = statistics.mean(r.elapsed for r in results)
        cells = [statistics.mean(r.loop.get(k, 0.0) for r in results) for k in parts]
        print(f"| {method.name} | " + " | ".join(f"{c:.2f} s ({c / max(elapsed, 1e-9):.1%})" for c in cells) + " |")


def run_method(method: Method, args, out_dir: Path) -> tuple[list[PeerResult], float, str]:
    """Runs bootstrap + peers in a fresh lab; returns per-peer results, wall seconds and the fragment log line."""
    if out_dir.exists():  # events.jsonl is appended to: start from an empty directory
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    started: list[Proc] = []
    t0 = time.monotonic()
    with NetnsLab(args.peers + 1) as lab:
        try:
            for i in range(1, args.peers + 1):
                lab.shape(i, args.rate_mbit)
            flags = ["--max-steps", args.steps, "--min-peers", args.peers, "--start-timeout", 90,
                     "--model-preset", args.preset, "--model-seq-len", args.seq_len,
                     "--data-batch-size", args.batch_size, "--inner-threads", 1,
                     "--inner-warmup-steps", 20, "--inner-total-steps", max(args.steps, 100),
                     "--outer-sync-every", args.sync_every, "--log-every", 10, "--status-interval", 0,
                     "--matchmaking-time", 5, "--matchmaking-timeout", 20, "--request-timeout", 3,
                     "--allreduce-timeout", 60, "--part-timeout", 30, "--progress-period", 2,
                     "--progress-ttl", 15, "--chunk-bytes", args.chunk_bytes, *method.flags]
            # with --pin, peer i (its torch thread, networking thread and p2pd) on CPU (i-1) mod nproc
            pin = (lambda i: [args.pin, "-c", str((i - 1) % os.cpu_count())]) if args.pin else (lambda i: [])
            boot, _, peers = start_lab_swarm(lab, started, out_dir, [flags] * args.peers, prefix=pin)
            deadline = t0 + args.timeout
            while any(p.returncode is None for p in peers.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{method.name}: peers still running after {args.timeout:g} s "
                                       f"(raise --timeout or lower --steps); logs in {out_dir}")
                time.sleep(POLL)
            wall = time.monotonic() - t0
            frag_line = next((line.split("peer.run.trainer: ", 1)[-1] for line in peers["p1"].lines()
                              if "fragment(s) of" in line), "")
            boot.terminate(timeout=30)
            return [peer_result(n, p, out_dir / n) for n, p in peers.items()], wall, frag_line
        finally:
            for proc in started:
                if proc.returncode is None or proc.session_pids():
                    proc.kill_group(signal.SIGKILL)


def fmt_mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=float, default=50.0, help="per-peer link rate, each direction (Mbit/s)")
    ap.add_argument("--steps", type=int, default=300, help="inner steps per peer (--max-steps)")
    ap.add_argument("--preset", default="tiny", help="model preset (peer/local/model.py)")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=50, help="H: inner steps between syncs of a fragment")
    ap.add_argument("--tau", type=lambda x: x if x == "auto" else int(x), default=20,
                    help="overlap of the streaming method (inner steps, or auto)")
    ap.add_argument("--tau-max", type=int, default=40, help="the bound of --tau auto (inner steps, < H)")
    ap.add_argument("--fragment-blocks", type=int, default=3, help="k of the streaming method")
    ap.add_argument("--codec", default="e3m0", help="wire codec of the streaming method (a topk codec adds "
                    "--outer-error-feedback)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--chunk-bytes", type=int, default=262144, help="fp32 bytes per streamed all-reduce message")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin peer i to CPU (i-1) mod nproc with taskset, so peers get equal CPU shares "
                         "(default on)")
    ap.add_argument("--only", choices=["blocking", "streaming"], help="run one method only")
    ap.add_argument("--timeout", type=float, default=140.0, help="seconds per method before giving up")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/bench_utilization")
    args = ap.parse_args(argv)
    if (args.tau != "auto" and not 0 <= args.tau <= args.sync_every) or args.peers < 2 \
            or args.steps < args.sync_every:
        ap.error("need 0 <= --tau <= --sync-every (or auto), --peers >= 2 and --steps >= --sync-every")

    args.pin = shutil.which("taskset") if args.pin else None
    ok, reason = netns_available()
    if not ok:
        print(f"cannot run: {reason} (this benchmark needs root for network namespaces)", file=sys.stderr)
        return 2
    print(f"{args.peers} peers + bootstrap in network namespaces, every peer link {args.rate_mbit:g} Mbit/s each "
          f"way (tc tbf); preset {args.preset}, seq {args.seq_len} x batch {args.batch_size}, H {args.sync_every}, "
          f"{args.steps} steps; {os.cpu_count()} CPUs, 1 torch thread per peer, "
          f"{'peers pinned to CPU (i-1) mod nproc' if args.pin else 'no CPU pinning'}")
    rows, fallback = [], False
    for method in methods(args):
        if args.only and method.name != args.only:
            continue
        results, wall, frag_line = run_method(method, args, args.out_dir / method.name)
        fallback |= any(r.fallback for r in results)
        bad = [r for r in results if r.exit_code != 0 or r.steps != args.steps]
        util = [r.utilization for r in results]
        wutil = [r.wall_utilization for r in results]
        sent = [b for r in results for b in r.bytes_sent]
        rsec = [s for r in results for s in r.round_seconds]
        rounds = {k: sum(r.rounds.get(k, 0) for r in results) for k in sorted({k for r in results for k in r.rounds})}
        rows.append((method, util, wutil, rounds, sent, rsec, wall, results))
        print(f"\n[{method.name}] {method.describe}; {frag_line}")
        for r in results:
            print(f"  {r.name}: exit {r.exit_code}, steps {r.steps}, compute {r.compute:.1f}s, "
                  f"blocked {r.blocked:.1f}s, elapsed {r.elapsed:.1f}s, utilization {r.utilization:.1%} "
                  f"(wall {r.wall_utilization:.1%}), "
                  f"rounds {r.rounds}")
        if bad:
            print(f"  WARNING: {[r.name for r in bad]} did not finish {args.steps} steps with exit 0 "
                  f"(logs in {args.out_dir / method.name})")

    print("\n| method | utilization mean | min | wall util. mean | min | rounds ok / all "
          "| sent per round per peer | round time (median) | sent per peer per H steps | steps/s per peer "
          "| training time | wall (with start) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method, util, wutil, rounds, sent, rsec, wall, results in rows:
        per_round = statistics.mean(sent) if sent else 0.0
        # every fragment syncs once per H steps: a peer's traffic per H steps is the sum of its fragments' rounds
        per_H = statistics.mean(sum(statistics.mean(b) for b in r.fragment_bytes.values()) for r in results)
        sps = statistics.mean(r.steps / max(r.elapsed, 1e-9) for r in results)
        print(f"| {method.name} | {statistics.mean(util):.1%} | {min(util):.1%} | {statistics.mean(wutil):.1%} | "
              f"{min(wutil):.1%} | {rounds.get('ok', 0)} / {sum(rounds.values())} | {fmt_mb(per_round)} | "
              f"{statistics.median(rsec) if rsec else 0:.2f} s | {fmt_mb(per_H)} | {sps:.2f} | "
              f"{statistics.mean(r.elapsed for r in results):.1f} s | {wall:.0f} s |")
    print_loop_parts(rows)
    if fallback:
        print("\nnote: compute_seconds/blocked_seconds were missing from step events: compute was estimated as "
              "steps x the mean step time of 10-step windows without a round launch or apply, blocked as the "
              "rest of the training wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
