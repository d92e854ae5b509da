"""Runs swarm test modules again and again, two at a time (the suite's load), and prints how often each passed.

    .venv/bin/python bench/flaky.py tests/test_swarm.py tests/test_phase_swarm.py --runs 5 [--parallel 2]

Each run is ``pytest -q -p no:cacheprovider MODULE`` in its own process with its own ``--basetemp`` (kept under
``--out-dir`` for the logs of a failure); a run that exceeds ``--timeout`` counts as failed and is killed with its
process group. The table: module, passes / runs, the seconds each run took. Exit 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import os
import signal
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(module: str, index: int, out_dir: Path, timeout: float) -> tuple[str, bool, float]:
    path, _, test = module.partition("::")  # (a test's node id names its own runs: test_x-name[case]-3)
    base = out_dir / re.sub(r"[^\w.\[\]-]+", "_", f"{Path(path).stem}{'-' + test if test else ''}-{index}")
    log = base.parent / f"{base.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module,
                                 f"--basetemp={base}"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            ok = proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            ok = False
    return module, ok, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--out-dir", default="runs/bench_flaky")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.parallel < 1:
        ap.error("--runs and --parallel must be >= 1")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(m, i) for i in range(args.runs) for m in args.modules]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: run_once(job[0], job[1], out, args.timeout), jobs))
    print(f"{'module':40} passed  seconds per run")
    for module in args.modules:
        mine = [(ok, s) for m, ok, s in results if m == module]
        print(f"{module:40} {sum(ok for ok, _ in mine)}/{len(mine)}    {' '.join(f'{s:.0f}' for _, s in mine)}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
