"""Chaos: a swarm whose peers are killed at random with SIGKILL and restarted from their run dirs.

    .venv/bin/python bench/chaos.py [--peers 4] [--duration 240] [--kill-every 30] [--seed 0] [--quick]

A bootstrap node and ``--peers`` peers on 127.0.0.1 (no root needed), the tiny preset with small settings
(seq 32 x batch 4, H = 20, tau 0, a checkpoint after every applied round of fragment 0:
``--checkpoint-rounds 1``). Once every peer has completed a round with the others, every ``--kill-every``
seconds (+-20 %, from the seeded RNG) one peer picked at random (seeded) is killed with SIGKILL -- its whole
process group, p2pd included: a crash -- and started again at once with the same ``--run-dir``, so it
resumes from its newest checkpoint and catches up with the swarm (state download / drift check). No kill
happens in the last ``--settle`` seconds; then the script waits (bounded) until every peer completed two
rounds together after the last restart, stops every peer with SIGTERM and the bootstrap node, and prints:

- kills survived: the killed peer resumed from its last checkpoint *and* later held the others' digest
  for a round after its restart (through a state download or a round averaged with them);
- rounds completed: (fragment, round) completed ok by at least two peers, and per peer;
- whether the survivors kept completing rounds while each victim was down;
- survivors' digests: one digest per (fragment, round) for the last rounds every peer completed ok;
- loss still falling: first vs last loss of every peer (across its restarts);
- work lost per kill: steps between the victim's last checkpoint ("checkpoint at step N") and its last step
  before the kill, checked against the step it resumed from (its ``resume`` event, logged as "resumed from
  ckpt-... at step N"), and how long it was gone (kill to resume: process, DHT and model start).

``--quick``: ~90 s of chaos (``--duration 90 --kill-every 20 --settle 25``). Logs and run dirs stay in
``--out-dir`` (default runs/bench_chaos; cleared at start). Every process it starts is killed at the end,
also on errors and Ctrl-C; the exit status is 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import Proc  # noqa: E402

POLL = 0.2
H = 20
CKPT_RE = re.compile(r"checkpoint at step (\d+): ")


@dataclass
class Kill:
    peer: str
    at: float  # unix time of the SIGKILL
    t: float  # seconds since the chaos began
    last_step: int | None  # the last step the victim logged before the kill (None: none since its restart)
    last_ckpt: int | None  # the step of its last completed checkpoint before the kill
    restarted: float = 0.0  # unix time of the restart
    resumed_step: int | None = None  # step of the next `resume` event ("resumed from ckpt-... at step N")
    agreed: tuple | None = None  # (fragment, round, how, seconds after the restart) of its first agreement
    survivors_rounds: int = 0  # rounds completed ok by the others while it was down
    resumed_after: float | None = None  # seconds from the kill to the resume (process and DHT start included)
    killed_again: bool = False  # killed again before it had resumed

    @property
    def lost(self) -> int:
        """Steps trained since the last checkpoint (0 if killed again before it trained a step)."""
        if self.last_step is None:
            return 0
        return self.last_step - (self.last_ckpt or 0)


@dataclass
class Peer:
    name: str
    run_dir: Path
    incarnations: list[Proc] = field(default_factory=list)

    @property
    def proc(self) -> Proc:
        return self.incarnations[-1]


def read_events(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            e = json.loads(line)
            if kind is None or e["event"] == kind:
                out.append(e)
    return out


def ok_rounds(peer: Peer, since: float = 0.0) -> dict[tuple[int, int], dict]:
    """{(fragment, round): the latest ok round event} logged after ``since`` (across incarnations)."""
    return {(e["fragment"], e["round"]): e for e in read_events(peer.run_dir, "round")
            if e["status"] == "ok" and e["time"] >= since}


def last_match(regex: re.Pattern, procs: list[Proc]) -> re.Match | None:
    for proc in reversed(procs):
        for line in reversed(proc.lines()):
            m = regex.search(line)
            if m:
                return m
    return None


def peer_args(args, name: str, run_dir: Path, initial: list[str], min_peers: int) -> list[str]:
    return [sys.executable, "-m", "peer", "run", "--config", REPO / "configs/demo.toml",
            "--initial-peers", *initial, "--run-dir", run_dir, "--log-json", run_dir / "events.jsonl",
            "--max-steps", 0, "--min-peers", min_peers, "--start-timeout", 90,
            "--model-preset", "tiny", "--model-seq-len", 32, "--data-batch-size", 4, "--inner-threads", 1,
            "--inner-warmup-steps", 10, "--outer-sync-every", H, "--outer-tau", 0,
            "--matchmaking-time", 4, "--matchmaking-timeout", 15, "--request-timeout", 2,
            "--allreduce-timeout", 20, "--part-timeout", 10, "--progress-period", 1, "--progress-ttl", 8,
            "--dht-timeout", 3, "--drift-check-period", 3, "--checkpoint-rounds", 1, "--status-interval", 0,
            "--log-every", 1]


class Chaos:
    def __init__(self, args):
        self.args = args
        self.out = args.out_dir
        self.rng = random.Random(args.seed)
        self.started: list[Proc] = []  # every process this script started (all incarnations)
        self.peers: dict[str, Peer] = {}
        self.kills: list[Kill] = []
        self.initial: list[str] = []
        self.t0 = 0.0

    # ---- processes ----------------------------------------------------------------------------------------
    def start_peer(self, peer: Peer, min_peers: int) -> Proc:
        log = self.out / f"{peer.name}.{len(peer.incarnations)}.log"
        proc = Proc.start(peer_args(self.args, peer.name, peer.run_dir, self.initial, min_peers), log_path=log,
                          cwd=REPO)
        self.started.append(proc)
        peer.incarnations.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.returncode is None or proc.session_pids():
                proc.kill_group(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(p.session_pids() for p in self.started) and time.monotonic() < deadline:
            time.sleep(POLL)
        left = {p.pid: p.session_pids() for p in self.started if p.session_pids()}
        if left:
            print(f"WARNING: processes survived SIGKILL of their group: {left}", file=sys.stderr)

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (logs in {self.out})")
            time.sleep(POLL)

    def check_running(self) -> None:
        for p in self.peers.values():
            if p.proc.returncode is not None:
                raise RuntimeError(f"{p.name} exited {p.proc.returncode} on its own; last lines of "
                                   f"{p.proc.log_path}:\n{p.proc.tail()}")

    def common_ok(self, since: float = 0.0) -> list[tuple[int, int]]:
        per = [set(ok_rounds(p, since)) for p in self.peers.values()]
        return sorted(set.intersection(*per))

    # ---- the run ----------------------------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        if self.out.exists():  # events.jsonl is appended to: start from an empty directory
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        boot = Proc.start([sys.executable, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                           "--identity-path", self.out / "boot.id"], log_path=self.out / "boot.log", cwd=REPO)
        self.started.append(boot)
        self.initial = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60).group(1).split()
        for i in range(1, a.peers + 1):
            peer = Peer(f"p{i}", self.out / f"p{i}")
            self.peers[peer.name] = peer
            self.start_peer(peer, a.peers)
        print(f"{a.peers} peers + bootstrap on 127.0.0.1; waiting for a round completed by all of them ...",
              flush=True)
        self.wait(lambda: self.check_running() or self.common_ok(), 240, "a round completed by every peer")
        self.t0, chaos_wall = time.monotonic(), time.time()
        print(f"chaos for {a.duration:g} s: a SIGKILL every ~{a.kill_every:g} s (seed {a.seed}), none in the "
              f"last {a.settle:g} s", flush=True)
        next_kill = self.t0 + self.jitter()
        while time.monotonic() - self.t0 < a.duration:
            self.check_running()
            now = time.monotonic()
            if now >= next_kill and now - self.t0 <= a.duration - a.settle:
                self.kill_and_restart(self.rng.choice(sorted(self.peers)))
                next_kill = time.monotonic() + self.jitter()
            time.sleep(POLL)
        last_restart = max((k.restarted for k in self.kills), default=chaos_wall)
        try:
            self.wait(lambda: self.check_running() or len(self.common_ok(last_restart)) >= 2, 90,
                      "two rounds completed by every peer after the last restart")
            settled = True
        except TimeoutError as e:
            print(f"WARNING: {e}", flush=True)
            settled = False
        end_wall = time.time()
        for p in self.peers.values():
            p.proc.popen.send_signal(signal.SIGTERM)
        exits = {}
        for p in self.peers.values():
            try:
                exits[p.name] = p.proc.popen.wait(timeout=60)
            except Exception:
                exits[p.name] = None
        boot_exit = boot.terminate(timeout=30)
        return self.report(chaos_wall, end_wall, settled, exits, boot_exit)

    def jitter(self) -> float:
        return self.args.kill_every * self.rng.uniform(0.8, 1.2)

    def kill_and_restart(self, name: str) -> None:
        peer = self.peers[name]
        procs = peer.incarnations
        ckpt = last_match(CKPT_RE, procs)  # a line is logged only after the file is renamed into place
        peer.proc.kill_group(signal.SIGKILL)
        at = time.time()
        self.wait(lambda: not peer.proc.session_pids(), 15, f"{name}'s processes to die")
        since = max([k.restarted for k in self.kills if k.peer == name], default=0.0)
        steps = [e["step"] for e in read_events(peer.run_dir, "step") if since < e["time"] <= at]
        kill = Kill(name, at, time.monotonic() - self.t0, steps[-1] if steps else None,
                    int(ckpt.group(1)) if ckpt else None)
        self.start_peer(peer, 1)
        kill.restarted = time.time()
        self.kills.append(kill)
        print(f"  t={kill.t:5.0f}s  SIGKILL {name} at step {kill.last_step} (last checkpoint at step "
              f"{kill.last_ckpt}); restarted", flush=True)

    # ---- the summary ------------------------------------------------------------------------------------
    def analyse_kill(self, i: int, kill: Kill, end_wall: float) -> None:
        peer = self.peers[kill.peer]
        # the first resume after the kill (a restarted peer may be killed again before it got that far)
        resume = [e for e in read_events(peer.run_dir, "resume") if e["time"] > kill.at]
        if resume:
            kill.resumed_step, kill.resumed_after = resume[0]["step"], resume[0]["time"] - kill.at
            kill.killed_again = any(k.peer == kill.peer and kill.at < k.at < resume[0]["time"] for k in self.kills)
        up_again = min([e["time"] for e in read_events(peer.run_dir, "round")
                        if e["time"] > kill.restarted and e["status"] == "ok"], default=end_wall)
        others = [p for p in self.peers.values() if p.name != kill.peer]
        down = [set(ok_rounds(p, kill.at)) for p in others]
        kill.survivors_rounds = len([k for k in set.intersection(*down)
                                     if ok_rounds(others[0], kill.at)[k]["time"] <= up_again])
        theirs = {}
        for p in others:
            for key, e in ok_rounds(p, kill.restarted).items():
                theirs.setdefault(key, set()).add(e["digest"])
        mine = [(e["time"], (e["fragment"], e["round"]), "downloaded", e["digest"])
                for e in read_events(peer.run_dir, "catch_up") if e["time"] > kill.restarted]
        mine += [(e["time"], key, "averaged", e["digest"]) for key, e in ok_rounds(peer, kill.restarted).items()]
        for t, key, how, digest in sorted(mine):
            if theirs.get(key) == {digest}:
                kill.agreed = (key[0], key[1], how, t - kill.restarted)
                break

    def report(self, chaos_wall: float, end_wall: float, settled: bool, exits: dict, boot_exit: int) -> int:
        a = self.args
        for i, kill in enumerate(self.kills):
            self.analyse_kill(i, kill, end_wall)
        by_key: dict[tuple[int, int], dict[str, str]] = {}
        for p in self.peers.values():
            for key, e in ok_rounds(p).items():
                by_key.setdefault(key, {})[p.name] = e["digest"]
        swarm_rounds = sorted(k for k, d in by_key.items() if len(d) >= 2)
        during = [k for k in swarm_rounds if min(
            e["time"] for p in self.peers.values() for kk, e in ok_rounds(p).items() if kk == k) >= chaos_wall]
        all_ok = [k for k, d in by_key.items() if len(d) == len(self.peers)]
        identical = [k for k in all_ok if len(set(by_key[k].values())) == 1]
        last_rounds = sorted(all_ok, key=lambda k: (k[1], k[0]))[-a.last:]  # fragment 1 syncs after fragment 0
        last_identical = all(len(set(by_key[k].values())) == 1 for k in last_rounds) and bool(last_rounds)
        losses = {}
        for p in self.peers.values():
            steps = read_events(p.run_dir, "step")
            first = statistics.mean(e["loss"] for e in steps[:10])
            last = statistics.mean(e["loss"] for e in steps[-10:])
            losses[p.name] = (first, last, steps[-1]["step"])
        survived = [k for k in self.kills if k.resumed_step is not None and k.agreed is not None]
        resumed_right = [k for k in self.kills if k.resumed_step == k.last_ckpt]
        lost = [k.lost for k in self.kills]
        step_s = statistics.median(
            (b["time"] - a_["time"]) / max(1, b["step"] - a_["step"])
            for p in self.peers.values() for a_, b in zip(read_events(p.run_dir, "step")[:-1],
                                                          read_events(p.run_dir, "step")[1:])
            if 0 < b["step"] - a_["step"] <= 2)

        print(f"\nchaos: {a.peers} peers, {len(self.kills)} SIGKILLs in {a.duration:g} s (every ~{a.kill_every:g} s, "
              f"seed {a.seed}); ran {end_wall - chaos_wall:.0f} s until every peer had completed two rounds after "
              f"the last restart{'' if settled else ' (NOT reached: bounded wait ran out)'}")
        print("\n| kill | t (s) | victim | last step | last checkpoint | work lost (steps) | resumed at step "
              "| resumed after | survivors' rounds while down | agreed again (after the restart) |")
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
        for i, k in enumerate(self.kills, 1):
            agreed = (f"f{k.agreed[0]} r{k.agreed[1]} ({k.agreed[2]}), {k.agreed[3]:.0f} s" if k.agreed else "NO")
            resumed = "-" if k.resumed_after is None else f"{k.resumed_after:.0f} s"
            if k.killed_again:
                resumed += " (killed again first)"
            last_step = "-" if k.last_step is None else k.last_step
            print(f"| {i} | {k.t:.0f} | {k.peer} | {last_step} | {k.last_ckpt} | {k.lost} | {k.resumed_step} | "
                  f"{resumed} | {k.survivors_rounds} | {agreed} |")
        back = [k.resumed_after for k in self.kills if k.resumed_after is not None] or [0]
        print(f"\nkills survived: {len(survived)}/{len(self.kills)} (resumed from the last checkpoint: "
              f"{len(resumed_right)}/{len(self.kills)}; kill to resume: median {statistics.median(back):.0f} s)")
        if lost:
            print(f"work lost per kill: mean {statistics.mean(lost):.1f} steps, max {max(lost)} steps "
                  f"(~{statistics.mean(lost) * step_s:.1f} s of training at {step_s * 1000:.0f} ms/step; a checkpoint "
                  f"follows every applied fragment-0 round, every {H} steps)")
        print(f"rounds completed (ok on >= 2 peers): {len(swarm_rounds)} ({len(during)} since the chaos began); "
              f"per peer: {', '.join(f'{p.name} {len(ok_rounds(p))}' for p in self.peers.values())}")
        print(f"survivors kept completing rounds while a victim was down: "
              f"{'yes' if all(k.survivors_rounds > 0 for k in self.kills) else 'NO'} "
              f"(min {min((k.survivors_rounds for k in self.kills), default=0)} rounds per kill)")
        print(f"digests: {len(identical)}/{len(all_ok)} rounds completed ok by every peer have one digest; "
              f"last {len(last_rounds)} ({', '.join(f'f{f} r{r}' for f, r in last_rounds)}): "
              f"{'identical' if last_identical else 'DIFFER'}")
        print("loss (mean of the first / last 10 logged steps): " + ", ".join(
            f"{n} {f:.2f} -> {last:.2f} (step {s})" for n, (f, last, s) in losses.items()))
        falling = all(last < f - 0.3 for f, last, _ in losses.values())
        print(f"loss still falling: {'yes' if falling else 'NO'}; exit codes at SIGTERM: {exits}, "
              f"bootstrap {boot_exit}")
        summary = dict(kills=[k.__dict__ | {"lost": k.lost} for k in self.kills], survived=len(survived),
                       rounds=len(swarm_rounds), rounds_during=len(during), identical=len(identical),
                       all_ok=len(all_ok), last_rounds=[list(k) for k in last_rounds], last_identical=last_identical,
                       losses=losses, exits=exits, settled=settled, step_seconds=step_s)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        good = (settled and len(survived) == len(self.kills) and last_identical and falling
                and all(v == 0 for v in exits.values()) and boot_exit == 0)
        return 0 if good else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of chaos (after the swarm formed)")
    ap.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between two SIGKILLs (+-20%%)")
    ap.add_argument("--settle", type=float, default=30.0, help="no kill in the last SETTLE seconds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the victim choice and the kill jitter")
    ap.add_argument("--last", type=int, default=4, help="how many of the last common rounds must agree")
    ap.add_argument("--quick", action="store_true", help="~90 s: --duration 90 --kill-every 20 --settle 25")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/bench_chaos")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.kill_every, args.settle = 90.0, 20.0, 25.0
    if args.peers < 2 or args.kill_every <= 0 or args.duration <= args.settle:
        ap.error("need --peers >= 2, --kill-every > 0 and --duration > --settle")
    chaos = Chaos(args)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        return chaos.run()
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); cleaning up", file=sys.stderr)
        return 130
    except (TimeoutError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        chaos.cleanup()


if __name__ == "__main__":
    sys.exit(main())
