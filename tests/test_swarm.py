"""Real swarms on 127.0.0.1: a bootstrap node and peer processes training with blocking DiLoCo.

Every process is started in its own session by the ``procs`` fixture, which kills whatever is
left (p2pd daemons included) and fails if anything survives.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from helpers import (Proc, assert_learned, assert_one_digest_per_applied_round, events,
                     final_digests, wait_for)
from test_export import assert_exports_agree_and_load_plainly

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[1]
# A crash mid-round can put the survivors out of phase by up to allreduce_timeout (30 s in demo.toml): one gets
# a connection error from the dead reducer at once, the other waits for its span. Patience
# (peer/net/policy/consensus.py) has the early one wait for the late one at the next round (before issue 11 this test
# needed a matchmaking_timeout longer than that offset: with demo.toml's 20 s the survivors missed each other in every
# later round).
ROUND_BUDGET = 20 + 30 + 10  # matchmaking_timeout + allreduce_timeout + slack (s)

FAST = ["--model-seq-len", "32", "--data-batch-size", "4", "--outer-sync-every", "20", "--matchmaking-time", "10",
        "--request-timeout", "3", "--progress-period", "1", "--progress-ttl", "8", "--dht-timeout", "3",
        "--status-interval", "0", "--inner-warmup-steps", "10", "--log-every", "10", "--drift-check-period", "3"]


def start_bootstrap(procs: list, tmp_path: Path, *extra: str) -> list[str]:
    boot = Proc.start([sys.executable, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                       "--identity-path", str(tmp_path / "boot.id"), *extra], log_path=tmp_path / "boot.log",
                      cwd=REPO)
    procs.append(boot)
    line = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60)
    return line.group(1).split()


def start_peer(procs: list, tmp_path: Path, name: str, initial_peers: list[str], max_steps: int, *extra: str) -> Proc:
    run_dir = tmp_path / name
    proc = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--initial-peers", *initial_peers, "--run-dir", str(run_dir),
                       "--log-json", str(run_dir / "events.jsonl"), "--max-steps", str(max_steps), *FAST, *extra],
                      log_path=tmp_path / f"{name}.log", cwd=REPO)
    procs.append(proc)
    return proc




def wait_exit(proc: Proc, timeout: float) -> int:
    wait_for(lambda: proc.returncode is not None, timeout, f"{proc.args[2:4]} to exit:\n{proc.tail()}")
    return proc.returncode


def test_three_peers_of_different_tau_agree_on_every_round_and_learn(procs, tmp_path):
    """Overlap is per peer: tau 0, 2 and 5 (eager on for the overlapping two) apply the same aggregates at
    different steps, so the shared outer parameters stay identical on every round while local weights differ."""
    initial = start_bootstrap(procs, tmp_path)
    taus = {"p0": ["--outer-tau", "0"], "p1": ["--outer-tau", "2", "--outer-eager"],
            "p2": ["--outer-tau", "5", "--outer-eager"]}
    names = list(taus)
    peers = [start_peer(procs, tmp_path, n, initial, 100, "--eval-every", "2", *taus[n]) for n in names]
    for name, proc in zip(names, peers):
        assert wait_exit(proc, 300) == 0, proc.tail()
        assert not proc.session_pids(), f"{name} left processes behind: {proc.session_pids()}"
    assert_one_digest_per_applied_round(tmp_path, names, shared=9)
    # the shared model on held-out data after fragment 0's rounds 2 and 4, on every peer: the same parameters (each
    # evaluation names its digests) give the same loss, whatever the peer's tau
    evals = {n: events(tmp_path, n, "eval") for n in names}
    assert all([e["rounds"][0] for e in got] == [2, 4] for got in evals.values()), evals
    by_state: dict[tuple, list[float]] = {}
    for got in evals.values():
        for e in got:
            by_state.setdefault(tuple(e["digests"]), []).append(e["loss"])
    assert len(by_state) == 2 and all(len(v) == 3 and max(v) - min(v) <= 1e-5 for v in by_state.values()), by_state
    rounds = {n: {(e["fragment"], e["round"]): e for e in events(tmp_path, n, "round")} for n in names}
    # tiny preset: 6 blocks, 3 per fragment -> P = 2; H = 20: fragment 0 syncs at 20, 40, .., 100,
    # fragment 1 (offset 10) at 30, 50, 70, 90
    expected = [(0, r) for r in range(1, 6)] + [(1, r) for r in range(1, 5)]
    assert all(sorted(r) == expected for r in rounds.values()), {n: sorted(r) for n, r in rounds.items()}
    for key in expected:
        got = [rounds[n][key] for n in names]
        assert all(e["status"] == "ok" and e["group_size"] == 3 for e in got), got
        assert len({e["digest"] for e in got}) == 1, f"{key}: digests differ: {[e['digest'] for e in got]}"
        for n, e in zip(names, got):  # applied tau steps after its launch; the last at max_steps (drained)
            assert e["applied"] and e["step"] == min(e["launch_step"] + int(taus[n][1]), 100), (n, e)
        # FP4 E3M0 both ways: with equal spans each peer sends (M-1)/M of its parts and its span's average to M-1
        # peers, i.e. 2*(M-1)/M elements per fragment element, at 4.5 bits each (+ a few bytes per message). Spans
        # that follow the links (swarm.span_sizing) move bytes between peers, not in all: the group's sum is
        # M*N + (M-2)*N elements whatever the spans.
        expected = 2 * (3 - 1) / 3 * got[0]["numel"] * 4.5 / 8
        for what in ("bytes_sent", "bytes_received"):
            total = sum(e[what] for e in got)
            assert abs(total - 3 * expected) / (3 * expected) < 0.10, (key, what, [e[what] for e in got], expected)
    # peak bytes per sync: one fragment of k = 3 blocks out of L = 6 carries ~k/L of a whole-model sync
    # (every fragment syncs once per H steps, so the fragments' bytes add up to one whole-model sync). Counted over
    # the group: one peer's share of a round follows its span, which follows the links (swarm.span_sizing).
    per_fragment = {f: sum(rounds[n][(f, 2)]["bytes_sent"] for n in names) for f in (0, 1)}
    share = max(per_fragment.values()) / sum(per_fragment.values())
    assert 0.45 < share < 0.5 + 0.03, per_fragment  # + the embedding that rides with fragment 0
    for n, proc in zip(names, peers):  # one console line per round at most: round detail is logged at DEBUG
        round_lines = [line for line in proc.lines() if re.search(r"^\S+ (INFO|WARN\w*) .*round \d+", line)]
        assert len(round_lines) <= len(rounds[n]), "\n".join(round_lines)
    assert all(final_digests(tmp_path, n) == final_digests(tmp_path, "p0") for n in names)  # one final state
    for n in names:  # 100 steps of 4 x 32 tokens: measured 45-50% of the gap to the floor closed on every peer
        assert_learned(tmp_path, n, closed=0.3)
    # the bootstrap node leaves cleanly too
    assert procs[0].terminate(timeout=30) == 0
    assert not procs[0].session_pids()
    # what they trained together goes home: every peer exports the same model, which loads without swarmloco
    assert_exports_agree_and_load_plainly(tmp_path, names)


def test_sigkill_during_a_round_survivors_skip_or_finish_and_keep_training(procs, tmp_path):
    initial = start_bootstrap(procs, tmp_path)
    names = ["p0", "p1", "victim"]
    # 240 steps: 12 rounds of fragment 0, time after the crash for the drift check (every 1 s here) to repair
    # survivors that a broken round left apart
    peers = dict(zip(names, (start_peer(procs, tmp_path, n, initial, 240, "--log-level", "DEBUG",  # see below
                                        "--drift-check-period", "1") for n in names)))
    victim = peers["victim"]
    victim.wait_for_line(r"fragment 0 round 2: group of 3 assembled", timeout=300)  # a DEBUG line
    victim.kill_group(signal.SIGKILL)  # the whole peer dies at once, p2pd included (a crash)
    survivors = ["p0", "p1"]
    for n in survivors:
        assert wait_exit(peers[n], 300) == 0, peers[n].tail()
    for n in survivors:
        rounds = {e["round"]: e for e in events(tmp_path, n, "round") if e["fragment"] == 0}
        assert sorted(rounds) == list(range(1, 13)), sorted(rounds)
        kill_round = rounds[2]
        assert kill_round["seconds"] < ROUND_BUDGET
        assert kill_round["status"] in ("ok", "partial", "no_group", "failed", "minority")
        if kill_round["status"] == "partial":  # never silent: logged and counted, and applied nowhere
            assert kill_round["spans_missing"] >= 1 and kill_round["spans_applied"] == 0
            assert any(re.search(r"round 2: span \d+ .* is missing and NOT applied", line)
                       for line in peers[n].lines())
        elif kill_round["status"] == "ok" and kill_round["spans_missing"]:  # the victim's span only: both lists
            # say the survivors' two came, more than half of three, so both apply them (one digest: below)
            assert kill_round["spans_missing"] == 1 and kill_round["spans_applied"] == 2
            assert any(re.search(r"round 2: span \d+ .* is missing and NOT applied: .*every list agrees", line)
                       for line in peers[n].lines())
    # Every round either survivor applied agrees, the kill round included; from the fifth round after it on, both
    # applied every round together; they end with one state.
    assert_one_digest_per_applied_round(tmp_path, survivors, shared=8)
    applied = {n: {e["round"] for e in events(tmp_path, n, "round") if e["fragment"] == 0 and e["applied"]}
               for n in survivors}
    assert all(set(range(7, 13)) <= a for a in applied.values()), applied
    assert final_digests(tmp_path, "p0") == final_digests(tmp_path, "p1")


def test_sigterm_leaves_cleanly_with_exit_0(procs, tmp_path):
    """A lone peer (--new-swarm) stopped with SIGTERM mid-training exits 0 and leaves no process."""
    run_dir = tmp_path / "solo"
    proc = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--new-swarm", "--min-peers", "1", "--run-dir", str(run_dir),
                       "--log-json", str(run_dir / "events.jsonl"), *FAST], log_path=tmp_path / "solo.log", cwd=REPO)
    procs.append(proc)
    proc.wait_for_line(r"fragment 0 round 1: alone, group 1", timeout=180)
    proc.popen.send_signal(signal.SIGTERM)
    assert wait_exit(proc, 60) == 0, proc.tail()
    assert not proc.session_pids()
    stop = events(tmp_path, "solo", "stop")
    assert stop and stop[-1]["reason"] == "stop signal" and stop[-1]["step"] >= 20
    assert any("left the swarm" in line for line in proc.lines())


def test_the_status_line_says_what_a_waiting_peer_waits_for(procs, tmp_path):
    """Alone with --min-peers 2: no silence, the status line says it waits for peers, how many, how long."""
    run_dir = tmp_path / "solo"
    proc = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--new-swarm", "--min-peers", "2", "--start-timeout", "60", "--run-dir", str(run_dir),
                       *FAST, "--status-interval", "0.5"], log_path=tmp_path / "solo.log", cwd=REPO)
    procs.append(proc)
    proc.wait_for_line(r"peer\.status: .*\| waiting for peers \(1/2 visible, up to \d+ s\) \|", timeout=180)
    proc.popen.send_signal(signal.SIGTERM)
    assert wait_exit(proc, 60) == 0, proc.tail()


def test_sigkill_of_the_main_process_leaves_no_orphans(procs, tmp_path):
    """kill -9 of the peer's main process (not its group): the DHT process and p2pd die with it."""
    run_dir = tmp_path / "solo"
    proc = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--new-swarm", "--min-peers", "1", "--run-dir", str(run_dir), *FAST],
                      log_path=tmp_path / "solo.log", cwd=REPO)
    procs.append(proc)
    proc.wait_for_line(r"starting to train", timeout=180)
    assert len(proc.session_pids()) >= 3  # main, DHT process, p2pd
    proc.popen.send_signal(signal.SIGKILL)
    wait_for(lambda: not proc.session_pids(), 15, f"the DHT process and p2pd to exit: {proc.session_pids()}")
