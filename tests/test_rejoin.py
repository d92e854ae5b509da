"""Joining a run in progress: state download, then identical digests. (Coming back after a crash, SIGKILL and a
restart from an older checkpoint: tests/test_phase_swarm.py, which also checks the resume and the download.)"""

from __future__ import annotations

import signal

import pytest

from helpers import applied_digests, assert_one_digest_per_applied_round, wait_for
from test_swarm import events, start_bootstrap, start_peer, wait_exit

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
SHORT_H = ["--outer-sync-every", "10", "--checkpoint-rounds", "1", "--drift-check-period", "3"]


def ok_rounds(tmp_path, name):
    return {(e["fragment"], e["round"]): e for e in events(tmp_path, name, "round") if e["status"] == "ok"}


@pytest.mark.timeout(600)
def test_new_peer_joins_after_round_5_downloads_state_and_agrees(procs, tmp_path):
    initial = start_bootstrap(procs, tmp_path)
    names = ["p0", "p1", "p2"]
    peers = {n: start_peer(procs, tmp_path, n, initial, 100000, *SHORT_H) for n in names}
    wait_for(lambda: (0, 6) in ok_rounds(tmp_path, "p0"), 300, "round 6 of fragment 0")
    joiner = start_peer(procs, tmp_path, "joiner", initial, 100000, *SHORT_H, "--min-peers", "1")
    m = joiner.wait_for_line(r"fragment 0: caught up to round (\d+)", timeout=180)
    assert int(m.group(1)) >= 6
    joiner.wait_for_line(r"fragment 1: caught up to round \d+", timeout=60)
    # (the event is written just after the log line: wait for it, CI once read the file in between)
    wait_for(lambda: {e["fragment"] for e in events(tmp_path, "joiner", "catch_up")} == {0, 1}, 10,
             "the joiner's catch_up events of both fragments")

    # The joiner applies a round with all three within three rounds of each fragment after its downloads; before
    # that it may join a round from a state a round old (the download raced the swarm's next round): then it
    # contributes and applies nothing (off_base). Every round that more than one peer applied has one digest.
    names = names + ["joiner"]
    caught = max(e["time"] for e in events(tmp_path, "joiner", "catch_up"))
    wait_for(lambda: any(len(v) == 4 for v in applied_digests(tmp_path, names).values()), 120,
             "a round all four applied")
    first = min((e for e in events(tmp_path, "joiner", "round") if e["applied"]), key=lambda e: e["time"])
    assert first["group_size"] == 4
    late = [e for e in events(tmp_path, "joiner", "round") if caught < e["time"] < first["time"]]
    assert len(late) <= 6, late
    assert_one_digest_per_applied_round(tmp_path, names)
    for proc in [*peers.values(), joiner]:
        proc.popen.send_signal(signal.SIGTERM)
    for proc in [*peers.values(), joiner]:
        assert wait_exit(proc, 90) == 0, proc.tail()
