"""Peak host memory of real peer processes: two peers of ``--preset`` on loopback train ``--steps`` steps
together (the demo config, eager, tau 2, a round every ``--sync-every`` steps per fragment), and the script prints
each peer's peak resident memory (``VmHWM`` of its main process, read until it exits) and its rounds applied.

    .venv/bin/python bench/peer_memory.py [--preset 35M] [--steps 60] [--sync-every 10] [--out-dir runs/peer_memory]

Unlike bench/gpu.py's memory columns (the engine's loop alone), this counts everything a peer holds: the served
snapshots, the DHT client, the checkpoint copy. Every process it starts is ended by pid before it returns.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def peak_gib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="35M")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the peers are killed")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/peer_memory")
    args = ap.parse_args(argv)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    args.out_dir.mkdir(parents=True)
    common = ["--config", str(REPO / "configs/demo.toml"), "--model-preset", args.preset, "--min-peers", "2",
              "--max-steps", str(args.steps), "--outer-sync-every", str(args.sync_every), "--outer-tau", "2",
              "--outer-eager", "--status-interval", "0", "--model-seq-len", "64", "--data-batch-size", "4"]
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *extra: str) -> None:
        log = open(args.out_dir / f"{name}.log", "w")
        procs[name] = subprocess.Popen([sys.executable, "-m", "peer", "run", *common, *extra, "--run-dir",
                                        str(args.out_dir / name)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    peaks: dict[str, float] = {}
    try:
        start("p1", "--new-swarm")
        deadline = time.monotonic() + args.timeout
        addr = None
        while addr is None and time.monotonic() < deadline and procs["p1"].poll() is None:
            found = re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", (args.out_dir / "p1.log").read_text())
            addr = found.group(1) if found else None
            time.sleep(0.2)
        if addr is None:
            print(f"p1 announced no address: see {args.out_dir / 'p1.log'}")
            return 1
        start("p2", "--initial-peers", addr)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            for name, p in procs.items():
                if (gib := peak_gib(p.pid)) is not None:
                    peaks[name] = gib
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    for name, p in procs.items():
        applied = re.search(r"(\d+) rounds applied", (args.out_dir / f"{name}.log").read_text())
        print(f"{name}: exit {p.returncode}, peak RSS {peaks.get(name, float('nan')):.2f} GiB, rounds applied "
              f"{applied.group(1) if applied else '?'}")
    return 0 if all(p.returncode == 0 for p in procs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
