"""Uneven and changing links: fixed deadlines against measured ones (peer/net/flow/links.py), and equal spans against
spans that follow the links (peer/net/round/group.py), in one invocation.

    sudo .venv/bin/python bench/uneven_links.py [--peers 4] [--fast-mbit 50] [--slow-mbit 1] [--slowdown-at 100]
                                                [--seconds 240] [--part-timeout 2] [--duty-cycle 20]
                                                [--methods fixed,measured,links]

Builds the network lab (``tests/netns.py``: namespaces on a private bridge, tc tbf per host link), a bootstrap
node in host 0 and ``--peers`` peers in hosts 1..N. Every link runs at ``--fast-mbit`` except two:

- the last peer's link is at ``--slow-mbit`` from the start (a DSL uplink in a swarm of fibre);
- the one before it drops from ``--fast-mbit`` to ``--slow-mbit`` ``--slowdown-at`` seconds after the peers
  started (a link that slows mid-run: a flatmate starts a video call).

The same swarm then trains for ``--seconds`` once per method, each in a fresh lab (then every peer is stopped
cleanly): ``fixed`` (``--deadlines fixed``: ``--part-timeout`` and ``--allreduce-timeout`` whatever the links),
``measured`` (those settings are floors, each group sizes its deadlines from its members' measured uplinks),
both with equal spans, and ``links`` (the defaults: measured deadlines, and each reducer's span in proportion to
its declared link). Timeouts and links are scaled to the lab's fragment (~0.6M parameters, 0.3 MB in e3m0): its parts
need ~2-3 s through 1 Mbit/s against a 2 s part timeout (4 s for the all-reduce), as a 50M-parameter fragment's
14 MB part needs ~50 s through a 3 Mbit/s DSL uplink against the default 30 s (60 s). Peers train at
``--duty-cycle`` percent (a round of each fragment every ~10-15 s, longer than a slow member's round: a swarm
whose rounds outrun a member's link leaves it behind whatever the deadlines), with ``tau = auto``.

Per method it prints the rounds by status, the rounds every peer applied with one digest, the spans applied, the
rounds whose total weight holds every peer's tokens, before and after the slowdown, the median round and its
deadline, and each peer's utilization (compute / (compute + blocked), the trainer's own accounting). Needs root.
Every process and namespace it starts is removed at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import Proc  # noqa: E402
from netns import NetnsLab, netns_available, start_lab_swarm  # noqa: E402
from utilization import PeerResult, peer_result, read_events  # noqa: E402

POLL = 0.2


class FinishedProc:
    """Stands for a peer of a saved run (--report): it exited cleanly."""

    returncode = 0


# what each method sets
METHODS = {"fixed": ["--deadlines", "fixed", "--span-sizing", "equal"],
           "measured": ["--deadlines", "measured", "--span-sizing", "equal"],
           "links": ["--deadlines", "measured", "--span-sizing", "links"]}


def run(method: str, args, out_dir: Path) -> tuple[list[PeerResult], dict[str, list[dict]], float]:
    """Trains the swarm once with ``method``'s settings (METHODS); returns per-peer results, round events and the
    wall time (time.time()) of the slowdown."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    started: list[Proc] = []
    n = args.peers
    with NetnsLab(n + 1) as lab:
        try:
            for i in range(1, n + 1):
                lab.shape(i, args.slow_mbit if i == n else args.fast_mbit)
            flags = ["--max-steps", 0, "--min-peers", n, "--start-timeout", 90, *METHODS[method],
                     "--limits-duty-cycle", args.duty_cycle, "--outer-tau", "auto",
                     "--outer-tau-max", args.sync_every // 2,
                     "--model-seq-len", 32, "--data-batch-size", 4, "--inner-threads", 1, "--outer-sync-every",
                     args.sync_every, "--log-every", 10, "--status-interval", 0, "--matchmaking-time", 5,
                     "--matchmaking-timeout", 20, "--request-timeout", 3, "--part-timeout", args.part_timeout,
                     "--allreduce-timeout", 2 * args.part_timeout, "--progress-period", 2, "--progress-ttl", 15]
            _, _, peers = start_lab_swarm(lab, started, out_dir, [flags] * n)
            t0, slowed = time.monotonic(), 0.0
            while time.monotonic() - t0 < args.seconds:
                if not slowed and time.monotonic() - t0 > args.slowdown_at:
                    lab.shape(n - 1, args.slow_mbit)
                    slowed = time.time()
                    (out_dir / "slowdown.txt").write_text(repr(slowed))
                    print(f"  [{method}] p{n - 1}'s link slowed to {args.slow_mbit:g} Mbit/s", flush=True)
                if any(p.returncode is not None for p in peers.values()):
                    raise RuntimeError(f"{method}: a peer exited early; logs in {out_dir}")
                time.sleep(POLL)
            for name, proc in peers.items():
                try:
                    proc.terminate(timeout=120)
                except TimeoutError:  # (its group is killed: what it wrote so far is read below)
                    print(f"  [{method}] {name} did not stop within 120 s of SIGTERM: killed", flush=True)
            results = [peer_result(name, proc, out_dir / name) for name, proc in peers.items()]
            rounds = {name: [e for e in read_events(out_dir / name / "events.jsonl") if e["event"] == "round"]
                      for name in peers}
            return results, rounds, slowed or float("inf")
        finally:
            for proc in started:
                if proc.returncode is None or proc.session_pids():
                    proc.kill_group(signal.SIGKILL)


def peer_rows(rounds: list[dict], since: float, until: float) -> dict:
    """One peer's rounds launched in [since, until): ok / launched, spans applied, the longest deadline given."""
    evs = [e for e in rounds if since <= e["time"] - e["seconds"] < until]
    applied = sum(e["spans_applied"] for e in evs)
    return {"ok": sum(e["status"] == "ok" for e in evs), "launched": len(evs),
            "spans": applied / max(1, applied + sum(e["spans_missing"] for e in evs)),
            "deadline": max((e.get("deadline", 0.0) for e in evs), default=0.0)}


def median_round(rounds: list[dict]) -> float:
    """The median wall time of the rounds that formed a group (from the search's start to the outcome)."""
    times = [e["seconds"] for e in rounds if e["group_size"] > 1]
    return statistics.median(times) if times else 0.0


def agreed(rounds: dict[str, list[dict]]) -> int:
    """Rounds every peer completed ok with one digest."""
    by_key: dict[tuple[int, int], dict[str, dict]] = {}
    for name, evs in rounds.items():
        for e in evs:
            by_key.setdefault((e["fragment"], e["round"]), {})[name] = e
    return sum(len(got) == len(rounds) and all(e["status"] == "ok" for e in got.values())
               and len({e["digest"] for e in got.values()}) == 1 for got in by_key.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--fast-mbit", type=float, default=50.0)
    ap.add_argument("--slow-mbit", type=float, default=1.0)
    ap.add_argument("--slowdown-at", type=float, default=100.0, help="seconds after start when p(N-1)'s link slows")
    ap.add_argument("--duty-cycle", type=int, default=20, help="percent of wall time each peer trains")
    ap.add_argument("--seconds", type=float, default=240.0, help="wall time each method trains")
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--part-timeout", type=float, default=2.0, help="the floor (measured) or the deadline (fixed); "
                    "the all-reduce timeout is twice it")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    ap.add_argument("--report", action="store_true", help="print the table of the runs in --out-dir, run nothing")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/bench_uneven_links")
    args = ap.parse_args(argv)
    if args.peers < 3:
        ap.error("--peers must be at least 3 (one slow from the start, one that slows, one fast)")
    ok, reason = netns_available()
    if not ok and not args.report:
        print(f"cannot run: {reason} (this benchmark needs root for network namespaces)", file=sys.stderr)
        return 2
    print(f"{args.peers} peers in network namespaces: links {args.fast_mbit:g} Mbit/s, p{args.peers} at "
          f"{args.slow_mbit:g} from the start, p{args.peers - 1} from {args.fast_mbit:g} to {args.slow_mbit:g} after "
          f"{args.slowdown_at:g} s; tiny preset, H {args.sync_every}, duty cycle {args.duty_cycle}%, tau auto, "
          f"{args.seconds:g} s each; part/all-reduce "
          f"timeouts {args.part_timeout:g}/{2 * args.part_timeout:g} s", flush=True)
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        ap.error(f"unknown method(s) {sorted(unknown)}: choose from {', '.join(METHODS)}")
    print("\n| method | peer | link | rounds ok / launched: before the slowdown | after | spans applied: before "
          "| after | longest deadline | median round (s) | steps | utilization |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for method in methods:
        out_dir = args.out_dir / method
        if args.report:
            names = sorted(p.name for p in out_dir.glob("p*") if p.is_dir())
            results = [peer_result(n, FinishedProc(), out_dir / n) for n in names]
            slowed = float((out_dir / "slowdown.txt").read_text())
            rounds = {n: [e for e in read_events(out_dir / n / "events.jsonl") if e["event"] == "round"]
                      for n in names}
        else:
            results, rounds, slowed = run(method, args, out_dir)
        for r in results:
            link = (f"{args.slow_mbit:g}" if r.name == f"p{args.peers}" else f"{args.fast_mbit:g} then "
                    f"{args.slow_mbit:g}" if r.name == f"p{args.peers - 1}" else f"{args.fast_mbit:g}")
            before, after = peer_rows(rounds[r.name], 0, slowed), peer_rows(rounds[r.name], slowed, float("inf"))
            print(f"| {method} | {r.name} | {link} | {before['ok']} / {before['launched']} | {after['ok']} / "
                  f"{after['launched']} | {before['spans']:.0%} | {after['spans']:.0%} | "
                  f"{max(before['deadline'], after['deadline']):.1f} s | {median_round(rounds[r.name]):.1f} | "
                  f"{r.steps} | {r.utilization:.1%} |", flush=True)
        steps, util = statistics.mean(r.steps for r in results), statistics.mean(r.utilization for r in results)
        every = [e for evs in rounds.values() for e in evs]
        print(f"| {method} | all | | rounds every peer applied with one digest: {agreed(rounds)} | | | | | "
              f"{median_round(every):.1f} | {steps:.0f} | {util:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
