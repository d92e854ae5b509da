"""Drop and rejoin on both schedules: the evidence behind a volunteer peer's default schedule.

    .venv/bin/python bench/phase.py [--quick] [--out-dir runs/bench_phase]

Part 1, disturbances. For each schedule (``steps``, ``clock``) and swarm size (2 and 3 peers) on 127.0.0.1, with
the settings of ``tests/test_phase_swarm.py`` (tiny preset, seq 32 x batch 4; steps: H = 20; clock: a round of
each fragment every 6 s): one peer is stopped with SIGINT and restarted 25 s later, one is killed with SIGKILL
and restarted 25 s later, one is paused with SIGSTOP for 30 s (longer than matchmaking_timeout and
progress_ttl). Per disturbance: the undisturbed peers' rounds and the seconds from the disturbed peer's return
(its first step) to the first round all peers averaged together (one digest), and the least of the other
peers' compute utilization (compute seconds / wall seconds) from the disturbance to that round.

Part 2, peers of different speeds (no disturbance): 3 peers, two at batch 4 and one at batch 12 (about 3x
the work per step), for ``--hetero-seconds`` on each schedule: steps made and compute utilization per peer.
The steps schedule makes the fast peers wait for the slow one at every round; the clock schedule does not.

``--quick``: 2 peers only in part 1 and 60 s in part 2. Logs stay in ``--out-dir`` (cleared at start). Every
process started is killed at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import wait_for  # noqa: E402
from lab_swarm import LoopbackSwarm, disturb_and_rejoin  # noqa: E402

DOWN_S, PAUSE_S = 25.0, 30.0  # restarted 25 s after it exited; paused 30 s
SCHEDULES = {
    "steps": ["--checkpoint-rounds", "2"],
    "clock": ["--outer-schedule", "clock", "--outer-round-seconds", "6", "--matchmaking-time", "2",
              "--request-timeout", "1.5", "--matchmaking-timeout", "5", "--checkpoint-rounds", "2"],
}


def kill_all(procs: list) -> None:
    for proc in procs:
        if proc.returncode is None or proc.session_pids():
            proc.kill_group(signal.SIGKILL)


def disturbances(schedule: str, n: int, out: Path) -> list[str]:
    procs: list = []
    try:
        swarm = LoopbackSwarm(procs, out, n, SCHEDULES[schedule])
        wait_for(lambda: len(swarm.together()) >= 2, 240, "two rounds all peers averaged together")
        plan = [("sigint", swarm.names[-1]), ("sigkill", swarm.names[0]), ("pause", swarm.names[min(1, n - 1)])]
        rows = []
        for kind, victim in plan:
            r = disturb_and_rejoin(swarm, kind, victim, down_s=DOWN_S, pause_s=PAUSE_S)
            rows.append(f"| {schedule} | {n} | {kind} ({victim}) | {r['rounds']} | {r['seconds']:.1f} | "
                        f"{r['others_computing']:.0%} |")
            print(rows[-1], flush=True)
        swarm.stop_all()
        return rows
    finally:
        kill_all(procs)


def heterogeneous(schedule: str, seconds: float, out: Path) -> list[str]:
    procs: list = []
    try:
        swarm = LoopbackSwarm(procs, out, 3, SCHEDULES[schedule], per_peer={"p2": ["--data-batch-size", "12"]})
        wait_for(lambda: len(swarm.together()) >= 1, 240, "a round all peers averaged together")
        t0 = time.monotonic()
        wait_for(lambda: time.monotonic() - t0 >= seconds, seconds + 5, "the measurement window")
        stats = {name: swarm.utilization(name) for name in swarm.names}
        together = len(swarm.together())
        swarm.stop_all()
        return [f"| {schedule} | {name} ({'batch 12' if name == 'p2' else 'batch 4'}) | {steps} | {util:.0%} | "
                f"{together} |" for name, (steps, util) in stats.items()]
    finally:
        kill_all(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default="runs/bench_phase")
    ap.add_argument("--hetero-seconds", type=float, default=120.0)
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    sizes = [2] if args.quick else [2, 3]
    seconds = 60.0 if args.quick else args.hetero_seconds
    print("| schedule | peers | disturbance | rounds to rejoin | seconds to rejoin | others computing |\n"
          "|---|---|---|---|---|---|", flush=True)
    rows = [row for schedule in SCHEDULES for n in sizes
            for row in disturbances(schedule, n, out / f"{schedule}-{n}")]
    print("\n| schedule | peer | steps | utilization | rounds together |\n|---|---|---|---|---|", flush=True)
    for schedule in SCHEDULES:
        for row in heterogeneous(schedule, seconds, out / f"hetero-{schedule}"):
            print(row, flush=True)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
