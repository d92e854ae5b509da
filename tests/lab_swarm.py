"""A loopback swarm of named peer processes, and the disturbances of drop and rejoin: a peer stopped with
SIGINT or SIGKILL and restarted with its run dir, paused with SIGSTOP (a laptop that sleeps), or a new peer that
joins the run in progress. Used by ``tests/test_phase_swarm.py`` and ``bench/phase.py``.

A disturbed peer is *back* at its first step event after its restart or SIGCONT (a new peer: after its state
download); from there the swarm has *rejoined* at the first round every peer completed ok, in a group of all,
with one digest.
"""

from __future__ import annotations

import os
import signal
import time

from helpers import events, wait_for
from test_swarm import start_bootstrap, start_peer, wait_exit

# How long a disturbed peer is away (restarted that long after it exited; paused that long). Longer than the others
# wait for a round (matchmaking_timeout: 20 s in demo.toml) and than progress_ttl (8 s): they stop seeing it.
DOWN_S = PAUSE_S = 22.0
REJOIN_TIMEOUT_S = 150.0


class LoopbackSwarm:
    """A bootstrap node and named peers (no --max-steps: they train until stopped)."""

    def __init__(self, procs, tmp_path, n: int, extra: list[str], per_peer: dict[str, list[str]] | None = None):
        """``procs`` collects every process started (the caller kills what is left); ``extra`` flags go to every
        peer, ``per_peer[name]`` to one."""
        self.procs, self.tmp, self.extra, self.per_peer = procs, tmp_path, extra, per_peer or {}
        self.initial = start_bootstrap(procs, tmp_path)
        self.names = [f"p{i}" for i in range(n)]
        self.peer = {name: self.start(name, "--min-peers", str(n)) for name in self.names}

    def start(self, name: str, *more: str):
        return start_peer(self.procs, self.tmp, name, self.initial, 0, *self.extra, *self.per_peer.get(name, []),
                          *more)

    def utilization(self, name: str, since: float = 0.0, until: float = float("inf")) -> tuple[int, float]:
        """(steps made, the fraction of wall time computing) of ``name`` between two of its step events in
        ``[since, until]`` of one incarnation (the latest there)."""
        window = [e for e in events(self.tmp, name, "step") if since <= e["time"] <= until]
        first = max((i for i, e in enumerate(window) if i == 0 or e["elapsed"] < window[i - 1]["elapsed"]),
                    default=0)  # the latest restart in the window
        if len(window) - first < 2:
            return 0, float("nan")
        a, b = window[first], window[-1]
        return b["step"] - a["step"], (b["compute_seconds"] - a["compute_seconds"]) / (b["elapsed"] - a["elapsed"])

    def ok_rounds(self, name: str, after: float = 0.0) -> dict:
        return {(e["fragment"], e["round"]): e for e in events(self.tmp, name, "round")
                if e["status"] == "ok" and e["time"] > after}

    def together(self, after: float = 0.0) -> list:
        """Rounds completed ok after ``after`` by every peer, each in a group of all, with one digest."""
        rounds = {n: self.ok_rounds(n, after) for n in self.names}
        common = set.intersection(*(set(r) for r in rounds.values()))
        return sorted(k for k in common if len({rounds[n][k]["digest"] for n in self.names}) == 1
                      and all(rounds[n][k]["group_size"] == len(self.names) for n in self.names))

    def first_step_after(self, name: str, t: float) -> float:
        """When ``name`` logged its first step event after ``t`` (it is training again)."""
        def step_time():
            for p in self.names:  # fail fast, with its log, if a peer died
                assert self.peer[p].returncode is None, f"{p} exited:\n{self.peer[p].tail()}"
            later = [e["time"] for e in events(self.tmp, name, "step") if e["time"] > t]
            return later[0] if later else None
        return wait_for(step_time, 180, f"{name} training again")

    def rejoined(self, victim: str, back: float) -> tuple[tuple, int, float]:
        """Waits for the first round after ``back`` that all peers averaged together; returns it, the most
        rounds any undisturbed peer took part in from ``back`` until then, and the seconds it took."""
        key = wait_for(lambda: (self.together(after=back) or [None])[0], REJOIN_TIMEOUT_S,
                       f"a round together after {victim} came back")
        done = max(e["time"] for n in self.names for k, e in self.ok_rounds(n).items() if k == key)
        rounds = max(len([e for e in events(self.tmp, n, "round") if back < e["time"] <= done])
                     for n in self.names if n != victim)
        return key, rounds, done - back

    def phase_log(self, lines: int = 15) -> str:
        """Each peer's last lines about phase and attendance (for an assertion's message: why a rejoin was slow)."""
        words = ("absent", "late", "caught up", "out of phase", "resumed", "no group")
        return "\n".join(f"{name}: {line}" for name in self.names for line in
                         [ln for ln in self.peer[name].lines() if any(w in ln for w in words)][-lines:])

    def stop_all(self) -> None:
        for proc in self.peer.values():
            proc.popen.send_signal(signal.SIGTERM)
        for name, proc in self.peer.items():
            assert wait_exit(proc, 90) == 0, proc.tail()


def disturb_and_rejoin(swarm: LoopbackSwarm, kind: str, victim: str, *, down_s: float = DOWN_S,
                       pause_s: float = PAUSE_S) -> dict:
    """Disturbs ``victim`` (``sigint``, ``sigkill``: restarted ``down_s`` later; ``pause``: SIGSTOP for
    ``pause_s``; ``join``: a new peer of that name joins the run in progress), waits until the swarm rejoined,
    and returns what it took (rounds, seconds)."""
    t0 = time.time()  # (wall clock, as in the events)
    if kind == "join":
        swarm.names.append(victim)
        swarm.peer[victim] = swarm.start(victim, "--min-peers", "1")
        t = time.time()
    elif kind in ("sigint", "sigkill"):
        if kind == "sigint":
            swarm.peer[victim].popen.send_signal(signal.SIGINT)
            assert wait_exit(swarm.peer[victim], 90) == 0, swarm.peer[victim].tail()
        else:
            swarm.peer[victim].kill_group(signal.SIGKILL)
        time.sleep(down_s)  # the disturbance itself (how long the peer is away), not a synchronization
        # Back counts from the restart: a SIGINTed peer logs the step it was in as it stops, and counting from
        # that step would add the time the peer was away to the rejoin.
        t = time.time()
        swarm.peer[victim] = swarm.start(victim, "--min-peers", "1")
    else:  # a laptop that sleeps: the whole process group stops, then continues
        os.killpg(swarm.peer[victim].pid, signal.SIGSTOP)
        time.sleep(pause_s)  # the disturbance itself (its length), not a synchronization
        os.killpg(swarm.peer[victim].pid, signal.SIGCONT)
        t = time.time()
    back = swarm.first_step_after(victim, t)
    key, rounds, seconds = swarm.rejoined(victim, back)
    others = [swarm.utilization(name, since=t0, until=back + seconds)[1] for name in swarm.names if name != victim]
    return dict(kind=kind, victim=victim, round=key, rounds=rounds, seconds=round(seconds, 1),
                others_computing=round(min(others), 2))
