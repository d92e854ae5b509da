"""The owner's controls in a real swarm (issue 15): three peers on loopback; one is paused, re-limited, resumed
and finished through the CLI (``swarm-peer pause | limits | resume | finish --run-dir R``) while the others keep
training with one digest; ``swarm-peer doctor`` run against the live swarm passes and counts who trains; the
operator's ``swarm-peer monitor`` follows it all, in its JSON API and in headless chromium: three peers, one of them
paused, then two when it has left."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from browser import browser_missing, headless_chromium, table_rows
from helpers import Proc, assert_one_digest_per_applied_round, events, wait_for
from lab_swarm import LoopbackSwarm
from test_swarm import FAST, REPO, wait_exit

pytestmark = [pytest.mark.swarm]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def status(run_dir) -> dict:
    done = cli("status", "--run-dir", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def pair_rounds(swarm: LoopbackSwarm, names: list[str], after: float) -> list:
    """Rounds ok after ``after`` on every peer of ``names``, in a group of exactly them, with one digest."""
    rounds = {n: swarm.ok_rounds(n, after) for n in names}
    common = set.intersection(*(set(r) for r in rounds.values()))
    return sorted(k for k in common if len({rounds[n][k]["digest"] for n in names}) == 1
                  and all(rounds[n][k]["group_size"] == len(names) for n in names))


class MonitorPage:
    """``swarm-peer monitor`` on the swarm, read through its JSON API and, where chromium is installed, its page."""

    def __init__(self, procs, tmp_path, initial: list[str], stack: contextlib.ExitStack):
        self.proc = Proc.start([sys.executable, "-m", "peer", "monitor", "--config", str(REPO / "configs/demo.toml"),
                                "--initial-peers", *initial, *FAST, "--port", "0", "--period", "1"],
                               log_path=tmp_path / "monitor.log", cwd=REPO)
        procs.append(self.proc)
        self.url = self.proc.wait_for_line(r"^monitor of run \S+ at (http://\S+) ", timeout=60).group(1)
        self.driver = None if browser_missing() else stack.enter_context(headless_chromium())
        if self.driver is not None:
            self.driver.get(self.url)

    def api(self) -> dict:
        with urllib.request.urlopen(self.url + "api/swarm", timeout=10) as reply:
            return json.loads(reply.read())

    def shows(self, states: dict[str, str], what: str, timeout: float = 30) -> None:
        """Waits until the API, then the page, list exactly the peers ``states`` names ({peer id: training|paused})."""
        wait_for(lambda: {p["peer_id"]: "paused" if p["paused"] else "training" for p in self.api()["peers"]}
                 == states, timeout, f"the monitor's API to show {what}")
        if self.driver is not None:
            want = {pid[-12:]: st for pid, st in states.items()}
            wait_for(lambda: {c[0]: c[2] for c in table_rows(self.driver, "#peers tbody tr")} == want, timeout,
                     f"the monitor's page to show {what}")


@pytest.mark.timeout(600)
def test_pause_limits_resume_and_finish_through_the_cli_while_the_others_train(procs, tmp_path):
    swarm = LoopbackSwarm(procs, tmp_path, 3, ["--status-interval", "1"])
    wait_for(lambda: swarm.together(), 240, "a round all peers averaged together")
    with contextlib.ExitStack() as stack:
        _controls_with_the_monitor_watching(swarm, procs, tmp_path, stack)


def _controls_with_the_monitor_watching(swarm: LoopbackSwarm, procs, tmp_path, stack: contextlib.ExitStack) -> None:
    p2 = tmp_path / "p2"
    ids = {n: events(tmp_path, n, "start")[-1]["peer_id"] for n in swarm.names}
    monitor = MonitorPage(procs, tmp_path, swarm.initial, stack)
    monitor.shows({ids[n]: "training" for n in swarm.names}, "three training peers")

    paused = cli("pause", "--run-dir", str(p2), "--wait", "90")
    assert paused.returncode == 0 and "pausing" in paused.stdout, paused.stderr
    pause = events(tmp_path, "p2", "pause")[-1]
    assert status(p2)["state"] == "PAUSED"
    monitor.shows({ids["p0"]: "training", ids["p1"]: "training", ids["p2"]: "paused"}, "p2 paused")
    # The others train on without it, in groups of two, and do not wait for it: its record says it is paused.
    wait_for(lambda: len(pair_rounds(swarm, ["p0", "p1"], pause["time"])) >= 2, 120, "2 rounds of p0 and p1")
    wait_for(lambda: status(tmp_path / "p0")["paused_peers"] == 1, 30, "p0 to see p2 as paused")
    assert not [e for e in events(tmp_path, "p2", "step") if e["time"] > pause["time"]], "p2 trained while paused"
    assert not [e for e in events(tmp_path, "p2", "round") if e["time"] > pause["time"]], "p2 averaged while paused"

    # swarm-peer doctor, as a newcomer to this swarm would run it: every check passes, and it counts the two
    # peers training (the paused one is not)
    doc = cli("doctor", "--config", str(REPO / "configs/demo.toml"), "--initial-peers", *swarm.initial, *FAST,
              "--run-dir", str(tmp_path / "newcomer"), "--json", "--timeout", "5")
    report = json.loads(doc.stdout.strip().splitlines()[-1])
    assert doc.returncode == 0 and report["ok"], doc.stdout + doc.stderr
    found = {c["name"]: c["found"] for c in report["checks"]}
    assert found["swarm"].startswith("2 peer(s) of this run") and " s against " in found["clock"], found
    assert "an initial peer dialed this machine back at /ip4/127.0.0.1/tcp/" in found["reachability"], found

    # (the upload cap stays on: the swarm keeps completing rounds with it after the resume)
    limited = cli("limits", "--run-dir", str(p2), "--duty-cycle", "50", "--threads", "1", "--upload-mbps", "40",
                  "--json")
    assert limited.returncode == 0, limited.stderr
    assert json.loads(limited.stdout)["limits"] == {"duty_cycle": 50, "threads": 1, "active_hours": "",
                                                   "upload_mbps": 40.0, "download_mbps": 0.0}
    assert status(p2)["limits"]["duty_cycle"] == 50
    refused = cli("limits", "--run-dir", str(p2), "--duty-cycle", "0")
    assert refused.returncode == 2 and "1..100" in refused.stderr
    assert cli("limits", "--run-dir", str(p2), "--duty-cycle", "100").returncode == 0

    t_resume = time.time()
    resumed = cli("resume", "--run-dir", str(p2))
    assert resumed.returncode == 0 and "resuming" in resumed.stdout, resumed.stderr
    wait_for(lambda: swarm.together(after=t_resume), 180, "a round all three averaged together after the resume")

    finished = cli("finish", "--run-dir", str(p2), "--wait", "120")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert wait_exit(swarm.peer["p2"], 60) == 0, swarm.peer["p2"].tail()
    stop = events(tmp_path, "p2", "stop")[-1]
    assert stop["reason"] == "finish requested"
    assert not (p2 / "control.json").exists()
    assert max(int(p.name[5:15]) for p in (p2 / "checkpoints").glob("ckpt-*.swl")) == stop["step"]
    monitor.shows({ids["p0"]: "training", ids["p1"]: "training"}, "p2 gone")
    # p0 and p1 hold one digest at each fragment's newest round (a poll between two peers' applies may not)
    wait_for(lambda: (v := monitor.api())["fragments"] and all(f["agree"] for f in v["fragments"]), 60,
             "the monitor to show each fragment's digests agreeing")
    view = monitor.api()
    assert view["loss"] is not None and view["history"] and view["tokens_per_second"] > 0, view

    wait_for(lambda: pair_rounds(swarm, ["p0", "p1"], stop["time"]), 120, "a round of p0 and p1 after p2 finished")
    for name in ("p0", "p1"):  # both at once: each completes its rounds in flight, then exits
        done = cli("finish", "--run-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stdout + done.stderr
    for name in ("p0", "p1"):
        assert wait_exit(swarm.peer[name], 120) == 0, swarm.peer[name].tail()
    # Every round that more than one of them applied holds one digest on all that applied it, through the pause,
    # the limits, the resume and the finish (peer/net/policy/agreement.py): no filter.
    assert swarm.together(), "no round of all three with one digest"
    assert_one_digest_per_applied_round(tmp_path, swarm.names, shared=4)
    assert monitor.proc.terminate(timeout=30) == 0, monitor.proc.tail()
    assert not monitor.proc.session_pids(), "the monitor left processes behind"
