"""Drop and rejoin in small swarms: a peer stopped with Ctrl-C, one killed with SIGKILL, one paused (a laptop that
sleeps) and a new one that joins the run in progress average with the others again, on both schedules, 2 peers
included.

Each test runs one swarm through disturbances, one after the other, each on a different peer where there are
enough of them:

1. SIGINT, then a restart with the same ``--run-dir`` (it resumes from its checkpoint);
2. SIGKILL of the whole process group, then a restart (from an older checkpoint);
3. SIGSTOP, then SIGCONT;
4. a new peer joins: it downloads the swarm's state of both fragments, then averages with the others.

Two steps peers go through the first three (the case that never met again before issue 11); three clock peers
of different speeds (batch sizes 2, 4 and 12) through the SIGKILL and the pause (a SIGINT restart is the SIGKILL
one from a newer checkpoint); three steps peers through the SIGKILL, which with three peers also resumes from a
checkpoint of averaged rounds, then a fourth joins. Before the clock peers are disturbed they apply four rounds all
three together, weighted by tokens, and the fastest makes more steps between them than the slowest: on the clock
schedule nobody waits for a slow peer. Every kind, on both schedules and with 2 and 3 peers: ``bench/phase.py``
(docs/benchmarks.md, "Drop and rejoin").

A peer is away longer than the others wait for a round (``matchmaking_timeout``) and than ``progress_ttl`` (the
others stop seeing it). After each disturbance, the disturbed peer is *back* at its first step event after the
restart, the SIGCONT or the download; from there the peers must complete a round together (status ok on every
peer, group of all, one digest) within ``BOUND_ROUNDS`` rounds of the undisturbed peers (rounds of any fragment
counted: with two fragments, six rounds are three of each) and within ``BOUND_S`` seconds. Every round that more
than one peer applied, before, during and after the disturbances, has one digest.
"""

from __future__ import annotations

import pytest

from helpers import applied_digests, assert_one_digest_per_applied_round, events, wait_for
from lab_swarm import LoopbackSwarm, disturb_and_rejoin

pytestmark = [pytest.mark.swarm]
# Rounds of each undisturbed peer from the disturbed one's return to the first round all of them average
# together: three rounds of each fragment (docs/architecture.md, "Phase": waited for, or realigned and at most
# one round launched from a heartbeat-old record, and one averaged from a state one round behind, which the
# drift check repairs). Measured (docs/benchmarks.md, "Drop and rejoin"): 1-4 on the steps schedule, 1 on the
# clock one.
BOUND_ROUNDS = 6
# The same in seconds: measured 0.4-4.6 s (docs/benchmarks.md); a clock round of a fragment every 3 s here, so
# BOUND_ROUNDS of them would be 18 s. About five times the slowest measured.
BOUND_S = 25.0
# A round waits matchmaking_timeout = 12 s for a group (demo.toml: 20 s), so a peer away 14 s is away longer than
# that and than progress_ttl (8 s): the others give up on it and stop seeing it.
STEPS = ["--checkpoint-rounds", "2", "--status-interval", "1", "--matchmaking-time", "6", "--matchmaking-timeout", "12"]
CLOCK = ["--outer-schedule", "clock", "--outer-round-seconds", "6", "--matchmaking-time", "2",
         "--request-timeout", "1.5", "--matchmaking-timeout", "5", "--checkpoint-rounds", "2"]


# The clock peers' speeds: tokens per step (a step of the slowest computes six times the fastest's)
CLOCK_BATCH = {"p0": "2", "p1": "4", "p2": "12"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule, n, away_s, kinds", [
    ("steps", 2, 14.0, ("sigint", "sigkill", "pause")), ("steps", 3, 14.0, ("sigkill", "join")),
    # The clock schedule's peers wait matchmaking_timeout = 5 s for a round.
    ("clock", 3, 12.0, ("sigkill", "pause"))])
def test_peers_average_together_again_after_a_restart_and_a_pause(procs, tmp_path, schedule, n, away_s, kinds):
    per_peer = {name: ["--data-batch-size", b] for name, b in CLOCK_BATCH.items()} if schedule == "clock" else None
    swarm = LoopbackSwarm(procs, tmp_path, n, STEPS if schedule == "steps" else CLOCK, per_peer)
    wait_for(lambda: swarm.together(), 240, "a round all peers averaged together")
    if schedule == "clock":
        assert_nobody_waits_for_the_slowest(swarm)
    # One disturbance per peer (with two peers, the first is disturbed twice); the checkpoint of the SIGKILLed
    # peer is up to --checkpoint-rounds old, so it resumes behind the others and downloads their state.
    victims = {"sigint": swarm.names[-1], "sigkill": swarm.names[0], "pause": swarm.names[min(1, n - 1)],
               "join": f"p{n}"}
    # (--checkpoint-rounds 2: after two rounds of fragment 0 it holds a checkpoint of averaged rounds)
    wait_for(lambda: list((tmp_path / victims["sigkill"] / "checkpoints").glob("ckpt-*.swl")), 120,
             f"a checkpoint of {victims['sigkill']}")
    results = [disturb_and_rejoin(swarm, kind, victims[kind], down_s=away_s, pause_s=away_s) for kind in kinds]
    print(f"{n} peers, {schedule}: {results}")
    # The SIGKILLed peer came back from its checkpoint (written after averaged rounds, waited for above); with 3
    # peers the other two averaged on while it was away, and it downloaded the swarm's state of what it missed
    # (with 2, the other peer had no one to average with: there was nothing to download).
    killed = swarm.peer[victims["sigkill"]]
    killed.wait_for_line(r"resumed from ckpt-\d+\.swl at step \d+", timeout=5)
    if n == 3:
        killed.wait_for_line(r"fragment \d: caught up to round \d+", timeout=5)
    if "join" in kinds:  # the new peer downloaded the swarm's state of both fragments before it trained
        joined = [e for e in events(tmp_path, victims["join"], ("catch_up", "step"))]
        first_step = next(i for i, e in enumerate(joined) if e["event"] == "step")
        assert {e["fragment"] for e in joined[:first_step]} == {0, 1}, joined[:first_step + 1]
        assert all(e["round"] >= 2 for e in joined[:first_step]), joined[:first_step]
    for r in results:
        assert r["rounds"] <= BOUND_ROUNDS and r["seconds"] <= BOUND_S, (results, swarm.phase_log())
    if schedule == "steps" and n == 2:  # the status line said what was going on, not repeated no_group lines
        # (with two peers, the one that comes back is far behind the other, which ran on alone: it moves up)
        status = [line for name in swarm.names for line in swarm.peer[name].lines() if "peer.status" in line]
        assert any("out of phase with the swarm: moved ahead" in line or "behind by wall time" in line
                   for line in status), "\n".join(status[-20:])
    swarm.stop_all()
    # every round that more than one peer applied, before, during and after each disturbance: one digest
    assert_one_digest_per_applied_round(tmp_path, swarm.names, shared=2)


def assert_nobody_waits_for_the_slowest(swarm: LoopbackSwarm) -> None:
    """Clock peers of different speeds apply rounds together (at least four, each with every peer's digest), and
    between the first and the last of them the fastest made more steps than the slowest. (Not the peers' last
    logged steps: they start at different times, and a first round that finds no group blocks one for seconds.)"""
    def four_shared() -> set | None:
        for name in swarm.names:  # fail fast, with its log, if a peer died
            assert swarm.peer[name].returncode is None, f"{name} exited:\n{swarm.peer[name].tail()}"
        applied = applied_digests(swarm.tmp, swarm.names)
        shared = {k for k, v in applied.items() if len(v) == len(swarm.names)}
        return shared if len(shared) >= 4 else None
    rounds = wait_for(four_shared, 120, "four rounds all three clock peers applied")
    advance = {}
    for name in swarm.names:
        at = [e["step"] for e in events(swarm.tmp, name, "round") if e.get("applied")
              and (e["fragment"], e["round"]) in rounds]
        advance[name] = max(at) - min(at)
    by_speed = sorted(CLOCK_BATCH, key=lambda name: int(CLOCK_BATCH[name]))  # fastest first
    assert advance[by_speed[0]] > advance[by_speed[-1]], advance
