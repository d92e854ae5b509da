"""Joining a run in progress and coming back after a crash: state download, then identical digests."""

from __future__ import annotations

import signal

import pytest

from helpers import wait_for
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
    catch_up = events(tmp_path, "joiner", "catch_up")
    assert {e["fragment"] for e in catch_up} == {0, 1}

    def joiner_agrees_on_a_round():
        mine = ok_rounds(tmp_path, "joiner")
        return [k for k in mine if all(k in ok_rounds(tmp_path, n) for n in names)]

    common = wait_for(joiner_agrees_on_a_round, 180, "a round completed by the joiner and all others")
    for key in common:
        digests = {ok_rounds(tmp_path, n)[key]["digest"] for n in names + ["joiner"]}
        assert len(digests) == 1, (key, digests)
    first = min(ok_rounds(tmp_path, "joiner"))
    assert ok_rounds(tmp_path, "joiner")[first]["group_size"] == 4
    for proc in [*peers.values(), joiner]:
        proc.popen.send_signal(signal.SIGTERM)
    for proc in [*peers.values(), joiner]:
        assert wait_exit(proc, 90) == 0, proc.tail()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("moment", ["training"])  # a kill mid-all-reduce: test_swarm.py's SIGKILL test
def test_peer_killed_and_restarted_resumes_and_catches_up(procs, tmp_path, moment):
    initial = start_bootstrap(procs, tmp_path)
    names = ["p0", "p1", "crash"]
    peers = {n: start_peer(procs, tmp_path, n, initial, 100000, *SHORT_H) for n in names}
    peers["crash"].wait_for_line(r"checkpoint at step \d+", timeout=300)
    wait_for(lambda: (0, 4) in ok_rounds(tmp_path, "crash"), 300, "round 4 on the peer to crash")
    if moment == "all-reduce":
        peers["crash"].wait_for_line(r"fragment 0 round 5: group of 3 assembled", timeout=120)
    peers["crash"].kill_group(signal.SIGKILL)
    killed_at = max(r for f, r in ok_rounds(tmp_path, "crash") if f == 0)
    wait_for(lambda: (0, killed_at + 3) in ok_rounds(tmp_path, "p0"), 300, "the survivors to move on")
    again = start_peer(procs, tmp_path, "crash", initial, 100000, *SHORT_H, "--min-peers", "1")
    again.wait_for_line(r"resumed from ckpt-\d+\.swl at step \d+", timeout=180)
    again.wait_for_line(r"fragment 0: caught up to round \d+", timeout=180)

    def restarted_agrees():
        mine = {k: e for k, e in ok_rounds(tmp_path, "crash").items() if k[1] > killed_at + 3}
        return [k for k in mine if all(k in ok_rounds(tmp_path, n) for n in ("p0", "p1"))]

    common = wait_for(restarted_agrees, 180, "a round after the restart completed by everyone")
    for key in common:
        assert len({ok_rounds(tmp_path, n)[key]["digest"] for n in names}) == 1, key
    for proc in [peers["p0"], peers["p1"], again]:
        proc.popen.send_signal(signal.SIGTERM)
    for proc in [peers["p0"], peers["p1"], again]:
        assert wait_exit(proc, 90) == 0, proc.tail()
