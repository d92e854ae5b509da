"""The owner's controls in a real swarm (issue 15): three peers on loopback; one is paused, re-limited, resumed
and finished through the CLI (``swarm-peer pause | limits | resume | finish --run-dir R``) while the others keep
training with one digest; ``swarm-peer doctor`` run against the live swarm passes and counts who trains."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from helpers import events, wait_for
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


@pytest.mark.timeout(600)
def test_pause_limits_resume_and_finish_through_the_cli_while_the_others_train(procs, tmp_path):
    swarm = LoopbackSwarm(procs, tmp_path, 3, ["--status-interval", "1"])
    wait_for(lambda: swarm.together(), 240, "a round all peers averaged together")
    p2 = tmp_path / "p2"

    paused = cli("pause", "--run-dir", str(p2), "--wait", "90")
    assert paused.returncode == 0 and "pausing" in paused.stdout, paused.stderr
    pause = events(tmp_path, "p2", "pause")[-1]
    assert status(p2)["state"] == "PAUSED"
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

    limited = cli("limits", "--run-dir", str(p2), "--duty-cycle", "50", "--threads", "1", "--json")
    assert limited.returncode == 0, limited.stderr
    assert json.loads(limited.stdout)["limits"] == {"duty_cycle": 50, "threads": 1, "active_hours": ""}
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

    wait_for(lambda: pair_rounds(swarm, ["p0", "p1"], stop["time"]), 120, "a round of p0 and p1 after p2 finished")
    for name in ("p0", "p1"):
        done = cli("finish", "--run-dir", str(tmp_path / name), "--wait", "120")
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_exit(swarm.peer[name], 60) == 0
    # Every round the three completed in one group has one digest on all of them. (A round a peer completed only
    # partly leaves its state off the others' until the drift check repairs it a round later: docs/architecture.md,
    # "A round"; the waits above asked for rounds with one digest after each control.)
    assert swarm.together(), "no round of all three with one digest"
    rounds = {n: swarm.ok_rounds(n) for n in swarm.names}
    for key in set.intersection(*(set(r) for r in rounds.values())):
        if all(rounds[n][key]["group_size"] == 3 for n in swarm.names):
            assert len({rounds[n][key]["digest"] for n in swarm.names}) == 1, key
