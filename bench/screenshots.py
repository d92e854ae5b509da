"""The screenshots in the README: a real loopback swarm (a bootstrap node and 3 demo peers), one of them paused
through the control API; the ``swarm-peer top`` dashboard of another captured headless (SVG), and the page of
``swarm-peer monitor`` on the swarm in headless chromium (PNG; skipped, with a line, without chromium).

    .venv/bin/python bench/screenshots.py [--out-top docs/images/swarm-peer-top.svg]
                                          [--out-monitor docs/images/swarm-monitor.png] [--seconds 60]

Every process started is ended at the end (the peers with ``swarm-peer finish``), also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from browser import browser_missing, headless_chromium, table_rows  # noqa: E402
from helpers import Proc, events, wait_for  # noqa: E402
from test_swarm import FAST  # noqa: E402

from peer.cli.top import TopApp  # noqa: E402
from peer.control.client import ControlClient  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-top", default="docs/images/swarm-peer-top.svg")
    ap.add_argument("--out-monitor", default="docs/images/swarm-monitor.png")
    ap.add_argument("--seconds", type=float, default=60.0, help="training before the screenshot")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swarmloco-top-"))
    procs: list[Proc] = []
    try:
        boot = Proc.start([sys.executable, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                           "--identity-path", str(tmp / "boot.id")], log_path=tmp / "boot.log", cwd=REPO)
        procs.append(boot)
        initial = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60).group(1).split()
        for name in ("p0", "p1", "p2"):
            procs.append(Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                                     "--initial-peers", *initial, "--run-dir", str(tmp / name), "--log-json",
                                     str(tmp / name / "events.jsonl"), *FAST, "--min-peers", "3"],
                                    log_path=tmp / f"{name}.log", cwd=REPO))
        wait_for(lambda: len(events(tmp, "p0", "round")) >= 3, 180, "p0's first rounds")
        monitor = Proc.start([sys.executable, "-m", "peer", "monitor", "--config", str(REPO / "configs/demo.toml"),
                              "--initial-peers", *initial, *FAST, "--port", "0", "--period", "2"],
                             log_path=tmp / "monitor.log", cwd=REPO)
        procs.append(monitor)
        url = monitor.wait_for_line(r"^monitor of run \S+ at (http://\S+) ", timeout=60).group(1)
        subprocess.run([sys.executable, "-m", "peer", "pause", "--run-dir", str(tmp / "p2"), "--wait", "90"],
                       cwd=REPO, check=True)
        time.sleep(args.seconds)  # the training window the curves show (a bench, not a synchronization)

        async def shoot() -> str:
            with ControlClient(tmp / "p0") as client:
                app = TopApp(client, refresh=0.5)
                async with app.run_test(size=(110, 30)) as pilot:
                    for _ in range(6):  # a few refreshes: the curves get their points
                        await pilot.pause(0.5)
                    out = Path(args.out_top).resolve()
                    out.parent.mkdir(parents=True, exist_ok=True)
                    return app.save_screenshot(filename=out.name, path=str(out.parent))

        print(asyncio.run(shoot()))
        if why := browser_missing():
            print(f"no monitor screenshot: {why}")
        else:
            with headless_chromium() as driver:
                driver.set_window_size(1100, 1150)
                driver.get(url)
                wait_for(lambda: len(table_rows(driver, "#peers tbody tr")) == 3, 30, "3 peer rows")
                out = Path(args.out_monitor).resolve()
                out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(out))
                print(out)
        for name in ("p0", "p1", "p2"):
            subprocess.run([sys.executable, "-m", "peer", "finish", "--run-dir", str(tmp / name), "--wait", "120"],
                           cwd=REPO, check=False)
        return 0
    finally:
        for proc in procs:
            proc.kill_group()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
