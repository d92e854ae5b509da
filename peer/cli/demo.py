"""``make demo``: a bootstrap node and three peers on this machine, then a summary.

Starts ``swarm-bootstrap`` on 127.0.0.1, three ``swarm-peer run`` processes from ``configs/demo.toml``
(CPU, tiny preset, synthetic corpus), waits for them to reach ``--max-steps``, stops the bootstrap
node and prints: loss at start and end next to the entropy floor, rounds completed, group sizes,
bytes exchanged, and whether all peers' digests agree for every round. Run dirs and logs are kept
under ``runs/demo/``. Ctrl-C stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _start(args: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:  # each process in its own session, so its p2pd dies with the group
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def _wait_line(proc: subprocess.Popen, log: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if m := re.search(pattern, line):
                return m
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{log} did not show {pattern!r} within {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def summarize(run_root: Path, names: list[str]) -> tuple[str, bool]:
    """The summary table and whether every round's digests agree across peers."""
    rows: list[str] = []
    digests: dict[tuple[int, int], set[str]] = {}
    for name in names:
        ev = _events(run_root / name / "events.jsonl")
        steps = [e for e in ev if e["event"] == "step"]
        rounds = [e for e in ev if e["event"] == "round"]
        for e in rounds:
            if e.get("applied"):  # (every peer that applied a round holds one digest after it)
                digests.setdefault((e["fragment"], e["round"]), set()).add(e["digest"])
        ok = sum(e["status"] == "ok" for e in rounds)
        sizes = sorted({e["group_size"] for e in rounds if e["group_size"]})
        up, down = sum(e["bytes_sent"] for e in rounds), sum(e["bytes_received"] for e in rounds)
        first, last = (steps[0], steps[-1]) if steps else ({}, {})
        rows.append(f"  {name}: loss {first.get('loss', float('nan')):.3f} -> {last.get('loss', float('nan')):.3f} "
                    f"(entropy floor {last.get('floor') or float('nan'):.3f}), rounds ok {ok}/{len(rounds)}, "
                    f"group sizes {sizes}, up {up / 2**20:.1f} MiB, down {down / 2**20:.1f} MiB")
    agree = bool(digests) and all(len(d) == 1 for d in digests.values())
    rows.append(f"  digests: {'identical on every peer for all' if agree else 'DISAGREE in some of the'} "
                f"{len(digests)} rounds")
    return "\n".join(rows), agree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peer.cli.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.toml")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--run-root", default="runs/demo")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the demo gives up")
    args = ap.parse_args(argv)
    root = Path(args.run_root)
    shutil.rmtree(root, ignore_errors=True)
    py = sys.executable
    procs: list[subprocess.Popen] = []
    names = [f"peer{i}" for i in range(args.peers)]
    try:
        boot_log = root / "bootstrap.log"
        boot = _start([py, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                       "--identity-path", str(root / "bootstrap.id")], boot_log)
        procs.append(boot)
        initial = _wait_line(boot, boot_log, r"^--initial-peers (.+)$", 60).group(1).split()
        print(f"bootstrap node up: --initial-peers {' '.join(initial)}", flush=True)
        for name in names:
            procs.append(_start([py, "-m", "peer", "run", "--config", args.config, "--initial-peers", *initial,
                                 "--run-dir", str(root / name), "--log-json", str(root / name / "events.jsonl"),
                                 "--max-steps", str(args.max_steps), "--min-peers", str(args.peers)],
                                root / f"{name}.log"))
        print(f"{args.peers} peers training {args.max_steps} steps each; logs in {root}/ "
              f"(follow one with: tail -f {root}/peer0.log)", flush=True)
        deadline = time.monotonic() + args.timeout
        last_report = 0.0
        while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                rounds = [len([e for e in _events(root / n / "events.jsonl") if e["event"] == "round"]) for n in names]
                steps = [max([e["step"] for e in _events(root / n / "events.jsonl") if e["event"] == "step"] or [0])
                         for n in names]
                print(f"  steps {steps}  rounds {rounds}", flush=True)
            time.sleep(1.0)
        codes = [p.poll() for p in procs[1:]]
        table, agree = summarize(root, names)
        print("\nswarmloco demo summary\n" + table, flush=True)
        if any(c != 0 for c in codes):
            print(f"peers exited with {codes} (see {root}/peerN.log)", flush=True)
            return 1
        return 0 if agree else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the swarm", flush=True)
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
