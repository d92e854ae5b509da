"""Swarms spread over hosts: one Linux network namespace per process, each with its own address.

A bootstrap node in host 0 (10.77.0.1) and four peers in hosts 1-4 (10.77.0.2-5) of a :class:`netns.NetnsLab`
(a private 10.77.0.0/24 on a bridge that exists only inside the lab). One run, in phases, each checked before
the next:

1. the four peers train and complete rounds together (group of 4), one digest per round;
2. host 4's link is pulled (``lab.cut``) for at least ``CUT_SECONDS``. The three others keep training as a group of 3,
   one digest among them (their leader waits ``--matchmaking-time`` for the cut peer until it has been silent
   for ``--progress-ttl``). The cut peer keeps training alone (none of its rounds is applied);
3. after ``lab.restore`` the cut peer is back within ``RECONNECT_S`` and then agrees with the others within
   ``REJOIN_ROUNDS`` rounds: it holds their digest for a round after the restore (downloaded by the drift
   check, the product's mechanism, or averaged with them) and then completes rounds with the group of 4. The
   three others never adopt the cut peer's state: it applied nothing for a minute, they did; then the four
   complete the last two rounds of both fragments together (the cut peer is in phase again);
4. the bootstrap node is stopped (SIGTERM, exit 0): the peers keep completing rounds together (group of 4, one
   digest, no round lost) without it;
5. SIGTERM to everyone: exit 0, nothing left (processes, namespaces); one digest on every round more than one
   peer applied, the cut and the rejoin included; the loss fell.

Steps schedule, blocking (tau 0), the tiny preset at seq 32 x batch 4, H = 20 (fragment 0 syncs after steps
20, 40, ..., fragment 1 after 30, 50, ...), peers run until SIGTERM. Skipped (with the reason) where network
namespaces cannot be created (not root, no iproute2, ...).
"""

from __future__ import annotations

import datetime
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import Proc, assert_learned, assert_one_digest_per_applied_round, events, wait_for
from netns import NetnsLab, netns_available, start_lab_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]

H = 20
# A short --progress-ttl, so the others stop waiting for the cut peer soon after the cut (a peer stays in view
# for TTL after its last record arrived). While host 4 is cut every DHT request that asks it waits DHT_TIMEOUT,
# so records arrive late: TTL must exceed PERIOD + 2 x DHT_TIMEOUT (the config refuses less).
PERIOD, TTL, DHT_TIMEOUT = 2.0, 10.0, 3.0
# 60 s: the scenario of issue 6 (a home router rebooting). Long enough for libp2p connections and DHT routing
# table entries of the cut host to time out on both sides, not only its progress record.
CUT_SECONDS = 60.0
# After a minute without link the cut peer's DHT node has dropped every neighbour (and they dropped it); alone,
# it pings the peers it knew every PERIOD (swarm.py) instead of waiting for libp2p to redial (measured 28-45 s
# before it did). Measured: seen again 2 s after the restore; the bound leaves room for a loaded machine.
RECONNECT_S = 30.0
SETTLED_ROUNDS = 6  # rounds the three others complete together once the cut peer's record expired
REJOIN_ROUNDS = 2  # the cut peer holds the others' digest by their 2nd round of a fragment after reconnecting
NAMES = ["p1", "p2", "p3", "p4"]  # peer i runs in lab host i (host 0: the bootstrap node)
CUT = "p4"
OTHERS = [n for n in NAMES if n != CUT]
FAST = ["--model-seq-len", "32", "--data-batch-size", "4", "--outer-sync-every", str(H),
        "--matchmaking-time", "4", "--matchmaking-timeout", "15", "--request-timeout", "2",
        "--allreduce-timeout", "20", "--part-timeout", "10",
        "--progress-period", str(PERIOD), "--progress-ttl", str(TTL), "--dht-timeout", str(DHT_TIMEOUT),
        "--drift-check-period", "3",
        "--status-interval", "0", "--inner-warmup-steps", "10", "--inner-threads", "1", "--log-every", "5",
        "--log-level", "DEBUG",  # round detail ("looking for a group", read below) is logged at DEBUG
        "--min-peers", str(len(NAMES)), "--start-timeout", "90", "--max-steps", "1000000"]


@pytest.fixture
def lab():
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    with NetnsLab(len(NAMES) + 1) as lab:
        yield lab
    assert not lab.namespaces(), f"namespaces left behind: {lab.namespaces()}"


def start_swarm(lab: NetnsLab, procs: list, tmp_path: Path) -> tuple[Proc, dict[str, Proc]]:
    """The bootstrap node in host 0, peer ``pI`` in host I; every one listens on its host's address only."""
    boot, _, peers = start_lab_swarm(lab, procs, tmp_path, [FAST] * len(NAMES))
    assert list(peers) == NAMES
    return boot, peers


def rounds_of(tmp_path: Path, name: str, *, status: str | None = "ok", since: float = 0.0) -> dict:
    """{(fragment, round): round event} of peer ``name`` (with that status; logged at or after ``since``).
    A later event of the same (fragment, round) replaces an earlier one."""
    return {(e["fragment"], e["round"]): e for e in events(tmp_path, name, "round")
            if (status is None or e["status"] == status) and e["time"] >= since}


def common_ok(tmp_path: Path, names: list[str], *, since: float = 0.0, group: int | None = None) -> list:
    """Sorted (fragment, round) that every peer in ``names`` completed ok (logged after ``since``; in a group
    of ``group`` if given)."""
    per = [{k for k, e in rounds_of(tmp_path, n, since=since).items() if group is None or e["group_size"] == group}
           for n in names]
    return sorted(set.intersection(*per))


def max_round(tmp_path: Path, names: list[str], fragment: int, *, before: float = float("inf")) -> int:
    return max((e["round"] for n in names for e in events(tmp_path, n, "round")
                if e["fragment"] == fragment and e["time"] < before), default=0)


def group_searches(proc: Proc, near: float) -> list[tuple[float, int]]:
    """(unix time, whole seconds; target group size) of every "looking for a group" line in ``proc``'s log."""
    ref, out = datetime.datetime.fromtimestamp(near), []
    for line in proc.lines():
        m = re.match(r"^(\d\d):(\d\d):(\d\d) .*: looking for a group \(weight [\d.]+, target (\d+)\)", line)
        if m:
            h, mi, s, target = map(int, m.groups())
            t = ref.replace(hour=h, minute=mi, second=s, microsecond=0)
            if (t - ref).total_seconds() < -12 * 3600:  # the run crossed midnight
                t += datetime.timedelta(days=1)
            out.append((t.timestamp(), target))
    return out


def timeline(tmp_path: Path, since: float = 0.0, names: list[str] = NAMES) -> str:
    """Every peer's round and catch-up events (after ``since``; rounds skipped alone left out), one line each,
    for failure messages."""
    out = []
    for n in names:
        for e in events(tmp_path, n, "round") + events(tmp_path, n, "catch_up"):
            if e["time"] < since or (e["event"] == "round" and e["status"] == "alone"):
                continue
            what = (f"round f{e['fragment']} r{e['round']} {e['status']} g{e['group_size']} step {e['step']}"
                    if e["event"] == "round" else
                    f"CATCH_UP f{e['fragment']} r{e['round']} step {e['step']} ({e['reason']})")
            out.append((e["time"], f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} {n}: {what} "
                                   f"{e['digest'][:10]}"))
    return "\n".join(line for _, line in sorted(out))


def stop_all(tmp_path: Path, peers: dict[str, Proc]) -> None:
    """SIGTERM to every peer: each exits 0 with a stop event, nothing of it left; it learned (measured: ~740 steps
    in this test's run, 89% of the gap to the entropy floor closed; at half the speed ~80%)."""
    for proc in peers.values():
        proc.popen.send_signal(signal.SIGTERM)
    for n, proc in peers.items():
        wait_for(lambda: proc.returncode is not None, 60, f"{n} to exit after SIGTERM:\n{proc.tail()}")
        assert proc.returncode == 0, f"{n} exited {proc.returncode}:\n{proc.tail()}"
        assert not proc.session_pids(), f"{n} left processes behind: {proc.session_pids()}"
        stop = events(tmp_path, n, "stop")
        assert stop and stop[-1]["reason"] == "stop signal", (n, stop)
        assert_learned(tmp_path, n, closed=0.6)


class Watch:
    """Deadline-bounded waits that fail at once, with the swarm's timeline, if a peer exited."""

    def __init__(self, tmp_path: Path, peers: dict[str, Proc]):
        self.tmp_path, self.peers = tmp_path, peers
        self.names = list(peers)

    def alive(self) -> bool:
        for n, proc in self.peers.items():
            assert proc.returncode is None, f"{n} exited {proc.returncode}:\n{proc.tail()}"
        return True

    def until(self, predicate, timeout: float, what: str, since: float = 0.0):
        try:
            return wait_for(lambda: self.alive() and predicate(), timeout, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{timeline(self.tmp_path, since, self.names)}") from None


def test_cut_link_the_cut_peer_rejoins_then_the_bootstrap_node_leaves(lab, procs, tmp_path):
    t_begin = time.monotonic()
    boot, peers = start_swarm(lab, procs, tmp_path)
    watch = Watch(tmp_path, peers)

    # ---- 1. four hosts train together and agree ----------------------------------------------------------
    watch.until(lambda: len([k for k in common_ok(tmp_path, NAMES, group=4) if k[0] == 0]) >= 2, 240,
                "two fragment-0 rounds completed ok by all four peers in a group of 4")
    for i, n in enumerate(NAMES, start=1):  # every peer announced its own host's address
        start = events(tmp_path, n, "start")
        assert all(m.startswith(f"/ip4/{lab.addr(i)}/") for m in start[0]["maddrs"]), start
    t_agree = time.monotonic() - t_begin

    # ---- 2. pull host 4's cable for CUT_SECONDS -------------------------------------------------------------
    lab.cut(NAMES.index(CUT) + 1)
    t_cut, cut_wall = time.monotonic(), time.time()
    watch.until(lambda: len(common_ok(tmp_path, OTHERS, since=cut_wall, group=3)) >= 3, CUT_SECONDS - 5,
                "three rounds completed ok by the three others in a group of 3 while host 4 is cut", cut_wall)
    t_three = time.monotonic() - t_cut
    # rounds launched once the cut peer's record had expired (TTL) and the round in flight at the cut (if any)
    # was over (matchmaking timeout): the others, as a group of 3, hold one state. The cut lasts CUT_SECONDS and
    # until they completed SETTLED_ROUNDS such rounds (a round count, not a speed: a loaded machine takes longer)
    settled = cut_wall + TTL + 15
    watch.until(lambda: time.monotonic() - t_cut >= CUT_SECONDS
                and len(common_ok(tmp_path, OTHERS, since=settled)) >= SETTLED_ROUNDS, CUT_SECONDS + 60,
                f"the {CUT_SECONDS:g} s cut to end, with {SETTLED_ROUNDS} rounds of the others", cut_wall)
    lab.restore(NAMES.index(CUT) + 1)
    restore_wall, t_restore = time.time(), time.monotonic()
    at_restore = {f: max_round(tmp_path, OTHERS, f) for f in (0, 1)}
    during = [k for k in common_ok(tmp_path, OTHERS, since=settled)
              if rounds_of(tmp_path, OTHERS[0])[k]["time"] < restore_wall]
    assert len(during) >= SETTLED_ROUNDS, f"the others completed only {during}\n{timeline(tmp_path, cut_wall)}"
    for key in during:
        got = [rounds_of(tmp_path, n)[key]["digest"] for n in OTHERS]
        assert len(set(got)) == 1, f"{key}: digests of the others differ: {got}\n{timeline(tmp_path, cut_wall)}"
    # the cut peer applied nothing while cut (no one to average with) and kept training alone
    cut_rounds = [e for e in events(tmp_path, CUT, "round") if cut_wall + 5 < e["time"] < restore_wall]
    assert cut_rounds and all(e["status"] != "ok" for e in cut_rounds), cut_rounds
    cut_steps = [e["step"] for e in events(tmp_path, CUT, "step") if cut_wall <= e["time"] < restore_wall]
    assert cut_steps and cut_steps[-1] - cut_steps[0] >= 2 * H, cut_steps

    # ---- 3. the cut peer comes back and agrees within REJOIN_ROUNDS rounds ---------------------------------
    stale = {e["digest"] for e in events(tmp_path, CUT, "round") if cut_wall + 5 < e["time"] < restore_wall}
    before_cut = {(e["fragment"], e["digest"]): e["round"] for e in events(tmp_path, CUT, "round")
                  if e["status"] == "ok" and e["time"] < cut_wall}

    def majority_kept_its_state():
        """The three others never replace their state by the cut peer's: they applied every round of the last
        minute, it applied none (its round counter moved on all the same: skipped rounds count)."""
        for n in OTHERS:
            adopted = [e for e in events(tmp_path, n, "catch_up") if e["time"] >= restore_wall and e["digest"] in stale]
            if adopted:
                e = adopted[0]
                steps = [s["step"] for s in events(tmp_path, n, "step") if s["time"] < e["time"]]
                raise AssertionError(
                    f"{n} adopted the cut peer's stale state after the restore: fragment {e['fragment']} 'round "
                    f"{e['round']}' ({e['reason']}) is G as {CUT} held it since its round "
                    f"{before_cut.get((e['fragment'], e['digest']), '?')}, before the cut; {n} threw away the rounds "
                    f"it applied since and its step jumped from {steps[-1] if steps else '?'} to {e['step']}\n"
                    f"{timeline(tmp_path, restore_wall - 10)}")
        return True

    def agreed(fragment):
        """(round, how) of the first round > the others' round at the restore for which the cut peer holds
        the others' digest of ``fragment``, or None."""
        theirs = {r: rounds_of(tmp_path, OTHERS[0])[(f, r)]["digest"] for f, r in
                  common_ok(tmp_path, OTHERS, since=restore_wall) if f == fragment and r > at_restore[fragment]}
        mine = [(e["round"], "downloaded", e["digest"]) for e in events(tmp_path, CUT, "catch_up")
                if e["fragment"] == fragment and e["time"] >= restore_wall]
        mine += [(r, "averaged", e["digest"]) for (f, r), e in rounds_of(tmp_path, CUT, since=restore_wall).items()
                 if f == fragment]
        hits = sorted((r, how) for r, how, d in mine if theirs.get(r) == d)
        return hits[0] if hits else None

    watch.until(lambda: majority_kept_its_state() and all(agreed(f) for f in (0, 1)), RECONNECT_S + 45,
                f"{CUT} to hold the others' digest of both fragments after the restore", restore_wall - 10)
    rejoin = {f: agreed(f) for f in (0, 1)}
    t_rejoin = time.monotonic() - t_restore
    # reconnected: the first moment after the restore that the cut peer looks for a group with anyone, or
    # the others look for a group of 4
    seen = [t for t, target in group_searches(peers[CUT], restore_wall) if t >= int(restore_wall) and target >= 2]
    seen += [t for n in OTHERS for t, target in group_searches(peers[n], restore_wall)
             if t >= int(restore_wall) and target == 4]
    seen += [e["time"] for e in events(tmp_path, CUT, "catch_up") if e["time"] >= restore_wall]
    t_seen = min(seen)
    assert t_seen - restore_wall <= RECONNECT_S, (t_seen - restore_wall, timeline(tmp_path, restore_wall - 10))
    at_seen = {f: max_round(tmp_path, OTHERS, f, before=t_seen + 1) for f in (0, 1)}
    for f, (r, how) in rejoin.items():
        assert r <= at_seen[f] + REJOIN_ROUNDS, (
            f"fragment {f}: {CUT} agreed only at round {r} ({how}); the others were at round {at_restore[f]} at "
            f"the restore and {at_seen[f]} when they met again, {t_seen - restore_wall:.0f} s after it\n"
            f"{timeline(tmp_path, restore_wall - 10)}")
    # ... and then trains with them, in phase again: the others' last two rounds of each fragment, completed by
    # all four. (Rounds here are a second apart; a peer back from a minute alone may first arrive a moment after a
    # group assembled and realign once or twice: phase 4 starts once that is over, so that it sees what the
    # bootstrap node's leaving does, not the rejoin.)
    def in_phase() -> bool:
        done = set(common_ok(tmp_path, NAMES, since=restore_wall, group=4))
        latest = {f: max_round(tmp_path, OTHERS, f) for f in (0, 1)}
        return all({(f, r), (f, r - 1)} <= done and r - 1 > rejoin[f][0] for f, r in latest.items())

    watch.until(lambda: majority_kept_its_state() and in_phase(), 60,
                f"the last two rounds of both fragments completed by all four after {CUT} agreed", restore_wall - 10)
    t_in_phase = time.monotonic() - t_cut - CUT_SECONDS

    # ---- 4. the bootstrap node leaves; the four go on without it, every round ok ---------------------------
    assert boot.terminate(timeout=30) == 0, boot.tail()
    assert not boot.session_pids(), boot.session_pids()
    gone = time.time()
    watch.until(lambda: len(common_ok(tmp_path, NAMES, since=gone, group=4)) >= 4, 120,
                "four rounds completed ok by all four peers after the bootstrap node left", gone - 10)
    after = common_ok(tmp_path, NAMES, since=gone, group=4)
    span = {f: (min(r for g, r in after if g == f), max(r for g, r in after if g == f)) for f in {f for f, _ in after}}
    for n in NAMES:  # no round lost on the way: from the first to the last of them, every round is ok on each
        bad = {(f, r): e["status"] for (f, r), e in rounds_of(tmp_path, n, status=None, since=gone).items()
               if f in span and span[f][0] <= r <= span[f][1] and e["status"] != "ok"}
        assert not bad, (n, bad, timeline(tmp_path, gone))

    # ---- 5. stop ------------------------------------------------------------------------------------------
    stop_all(tmp_path, peers)
    # One digest per (fragment, round) on every peer that applied it, before the cut, during it and after the
    # restore: the cut peer's rounds from its stale state are off_base (its part counted, nothing applied).
    assert_one_digest_per_applied_round(tmp_path, NAMES, shared=4)
    print(f"\n{time.monotonic() - t_begin:.0f} s in all: four agreed {t_agree:.0f} s after the start; group of 3 "
          f"{t_three:.0f} s into the cut; after the restore {CUT} was seen again after {t_seen - restore_wall:.0f} s "
          f"and agreed after {t_rejoin:.0f} s: {rejoin} (others at {at_restore} at the restore, {at_seen} when "
          f"they met again), in phase after {t_in_phase:.0f} s; {len(after)} rounds of 4 after the bootstrap node "
          "left")

