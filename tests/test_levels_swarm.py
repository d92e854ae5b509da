"""Bounded groups in a real swarm: 8 peer processes on loopback with ``--group-cap 4`` run every round in two
levels (two groups of 4, whose reducers meet per slot: peer/net/round/levels.py) and hold one digest. The 16-peer
version (and the same swarm in one group, for comparison) is ``bench/levels.py``: 16 processes on 2 cores take
minutes per run."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_one_digest_per_applied_round, events, final_digests
from test_swarm import start_bootstrap, start_peer, wait_exit

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]

STEPS = 60  # sync_every 20: fragment 0 syncs at 20, 40, 60 and fragment 1 at 30, 50
# Lighter than the other swarm tests (many processes share 2 cores): short sequences, records every 3 s, each
# peer trains a quarter of the time; a round's timeouts leave room for level 2 (the roster, matchmaking, the
# slot's all-reduce).
LEVELS = ["--matchmaking-timeout", "40", "--allreduce-timeout", "60", "--part-timeout", "20", "--progress-period",
          "3", "--progress-ttl", "20", "--model-seq-len", "16", "--limits-duty-cycle", "25"]


def run_swarm(procs: list, tmp_path: Path, n: int, cap: int, steps: int = STEPS, timeout: float = 700) -> dict:
    """Runs ``n`` peers with ``--group-cap cap`` (0: one group of all) for ``steps`` steps; returns each peer's
    round events by (fragment, round)."""
    initial = start_bootstrap(procs, tmp_path)
    names = [f"p{i}" for i in range(n)]
    peers = [start_peer(procs, tmp_path, name, initial, steps, "--min-peers", str(n), "--start-timeout", "240",
                        "--group-cap", str(cap), *LEVELS) for name in names]
    for name, proc in zip(names, peers):
        assert wait_exit(proc, timeout) == 0, f"{name}:\n{proc.tail()}"
    return {name: {(e["fragment"], e["round"]): e for e in events(tmp_path, name, "round")} for name in names}


def agreed_rounds(rounds: dict) -> list:
    """The rounds every peer completed ok with one digest."""
    names = list(rounds)
    everyone = set.intersection(*(set(r) for r in rounds.values()))
    return [k for k in sorted(everyone) if all(rounds[n][k]["status"] == "ok" for n in names)
            and len({rounds[n][k]["digest"] for n in names}) == 1]


def test_eight_peers_with_a_group_cap_of_four_agree_in_two_levels(procs, tmp_path):
    rounds = run_swarm(procs, tmp_path, 8, cap=4)
    names = list(rounds)
    assert_one_digest_per_applied_round(tmp_path, names, shared=3)  # every round, no filter
    agreed = agreed_rounds(rounds)
    launched = set().union(*rounds.values())
    summary = {k: sorted((rounds[n][k]["status"], rounds[n][k]["group_size"], int(rounds[n][k]["total_weight"]))
                         for n in names if k in rounds[n]) for k in sorted(launched)}
    # every round applied by all 8 with one digest, but the first of a fragment, which may find the swarm still
    # arriving while 9 processes start on 2 cores
    assert set(launched) - set(agreed) <= {(0, 1), (1, 1)} and {f for f, _ in agreed} == {0, 1}, summary
    assert all(final_digests(tmp_path, n) == final_digests(tmp_path, "p0") for n in names)  # one final state
    for k in agreed:
        got = [rounds[n][k] for n in names]
        assert all(e["group_size"] <= 4 for e in got), summary[k]  # groups of at most the cap: two levels
        # and every peer's contribution is in it: the total weight is all 8 peers' tokens (equal batches)
        assert len({e["total_weight"] for e in got}) == 1 and got[0]["total_weight"] >= 8 * 20 * 4 * 16 * 0.99
    # the swarm learns: one batch's loss is noisy at this size (60 steps of 16 tokens: one peer's last logged
    # loss may be above its first), so the peers' mean over the last two logs against the first two
    first, last = [], []
    for n in names:
        losses = [e["loss"] for e in events(tmp_path, n, "step")]
        first.append(sum(losses[:2]) / 2)
        last.append(sum(losses[-2:]) / 2)
    assert sum(last) < sum(first), (first, last)
