"""Attacks that need the swarm's processes (issue 13): loopback swarms of honest peers and one hostile peer
(bench/hostile_peer.py), against a clean swarm in the same invocation.

    .venv/bin/python bench/swarm_attacks.py                    # 4 honest + 1 attacker, every attack: ~12 min
    .venv/bin/python bench/swarm_attacks.py --attacks lying_reducer,forged_donor
    .venv/bin/python bench/swarm_attacks.py --authority ...    # an authenticated run: the attacker holds a pass

Each run: a bootstrap node, ``--honest`` peers and one more (honest in the clean run, absent in ``absent``,
hostile otherwise) on
127.0.0.1 with the settings of tests/test_swarm.py (tiny preset, seq 32 x batch 4, H = 20, 2 fragments) for
``--steps`` steps. In ``forged_donor`` the last honest peer is killed (SIGKILL) after two rounds and
restarted from its checkpoint, so it downloads the swarm's state while the attacker is among the donors.
With ``--authority`` every run is authenticated (``swarm.authority``): an authority made for the invocation issues
a pass to each peer, the attacker's identity included (an insider; one without a pass is refused at every entry
point: tests/test_auth.py), and the bootstrap node checks them too. Its made-up ids hold no pass.

Prints one table (and writes ``--out``, JSON): per attack, the honest peers' final training CE (mean over
their last 40 steps) and its change against the clean run (and, where ``absent`` ran, against the honest peers
alone: an attacker that brings no honest data costs at least that), the held-out CE of the shared model at the
honest peers' end (less noisy: the training CE of one clean run varies by 2-3% from run to run), the honest
peers' rounds that ended
ok, how many honest peers excluded the attacker and at which of their rounds the first did, how many
honest peers caught up from a forged state (a ``catch_up`` event whose digest no honest peer ever held),
how many forged things the attacker did (its ``HOSTILE:`` lines), the honest peers' run time, their rounds'
matchmaking time, how many ``peer_absent`` events they logged (peer/net/view/attendance.py), and in how many
rounds the honest peers that applied them hold more than one digest after them (the invariant).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import Proc, applied_digests, events, in_process, wait_for  # noqa: E402
from test_swarm import FAST, start_bootstrap, wait_exit  # noqa: E402

# "absent": the extra peer never starts: what an attacker excluded at once would cost (its data is lost)
ATTACKS = ["clean", "absent", "lying_reducer", "erring_reducer", "two_faced_reducer", "round_breaker", "sybil_majority",
           "far_ahead", "served_ahead", "forged_donor", "shadowing", "phantom_group", "equivocator"]


EXTRA: list[str] = []  # flags for every peer of every run (--aggregator; --authority's public key)
AUTHORITY: list[Path] = []  # --authority: the invocation's authority directory (swarm-bootstrap authority init)


def issue_passes(out: Path, names: list[str]) -> None:
    """A pass from the invocation's authority in each named peer's run dir (``pass.txt``, where ``swarm.pass_path``
    looks by default), for the identity ``swarm-peer pass-request`` makes there."""
    from bootstrap.cli import main as bootstrap_main
    from peer.cli.swarm_peer import main as peer_main

    for name in names:
        request = in_process(peer_main, "pass-request", "--run-dir", str(out / name)).stdout.strip()
        issued = in_process(bootstrap_main, "authority", "issue", str(AUTHORITY[0]), request, "--days", "1")
        assert issued.returncode == 0, issued.stderr
        (out / name / "pass.txt").write_text(issued.stdout)


def start(procs: list, out: Path, name: str, initial: list[str], steps: int, n: int, attack: str | None) -> Proc:
    run_dir = out / name
    entry = ["-m", "peer"] if attack is None else [str(REPO / "bench" / "hostile_peer.py"), attack]
    proc = Proc.start([sys.executable, *entry, "run", "--config", str(REPO / "configs/demo.toml"),
                       "--initial-peers", *initial, "--run-dir", str(run_dir), "--log-json",
                       str(run_dir / "events.jsonl"), "--max-steps", str(steps), "--min-peers", str(n), *FAST,
                       "--log-every", "2", *EXTRA],
                      log_path=out / f"{name}.log", cwd=REPO)
    procs.append(proc)
    return proc


LAST_STEPS = 40  # the final CE: the mean training CE over a peer's last 40 steps (logged every 2)


def final_ce(out: Path, name: str) -> float:
    steps = events(out, name, "step")[-LAST_STEPS // 2:]
    return sum(e["ce"] for e in steps) / max(1, len(steps))


def held_out_ce(out: Path, name: str) -> float:
    """The loss of the shared model (``G``) on held-out data at a peer's last evaluation (its end): less noisy
    than the training CE, and the same for peers on one digest. NaN without one."""
    evals = events(out, name, "eval")
    return evals[-1]["loss"] if evals else math.nan


def one_run(attack: str, honest: int, steps: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    procs: list = []
    names = [f"h{i}" for i in range(honest)]
    try:
        size = honest if attack == "absent" else honest + 1
        if AUTHORITY:
            issue_passes(out, names + ([] if attack == "absent" else ["x"]))
        initial = start_bootstrap(procs, out, *(["--authority", str(AUTHORITY[0])] if AUTHORITY else []))
        t0 = time.monotonic()
        peers = {n: start(procs, out, n, initial, steps, size, None) for n in names}
        bad = None if attack == "absent" else \
            start(procs, out, "x", initial, steps, size, None if attack == "clean" else attack)
        if attack == "forged_donor":  # a peer that restarts downloads the swarm's state, the attacker a donor
            victim = names[-1]
            wait_for(lambda: len([e for e in events(out, victim, "round") if e["status"] == "ok"]) >= 2, 300,
                     f"two rounds of {victim}")
            peers[victim].kill_group(signal.SIGKILL)
            peers[victim] = start(procs, out, victim, initial, steps, size, None)
        for n in names:
            wait_exit(peers[n], 900)
        wall = time.monotonic() - t0
        bad_id = events(out, "x", "start")[0]["peer_id"] if bad is not None and events(out, "x", "start") else ""
        if bad is not None and bad.returncode is None:  # an attacker whose own rounds hang may never finish
            try:
                wait_exit(bad, 120)
            except TimeoutError:
                print(f"  ({attack}: the attacker had not finished 120 s after the honest peers; killed)")
        if bad is not None and bad.returncode not in (0, None):  # (its row then measures an absent peer)
            print(f"  ({attack}: the attacker exited {bad.returncode}:\n{bad.tail()})")
    finally:
        for proc in procs:
            if proc.returncode is None or proc.session_pids():
                proc.kill_group(signal.SIGKILL)
    # the states honest rounds produced (a round that did not apply reports the state a peer holds, which may be
    # one it adopted: a forged state adopted by all was then counted as honest)
    honest_digests = {e["digest"] for n in names for e in events(out, n, "round")
                      if e.get("digest") and e["status"] == "ok"}
    excluded_at = {n: e["time"] for n in names for e in events(out, n, "peer_excluded") if e["peer"] == bad_id}
    first_exclusion = min((sum(1 for r in events(out, n, "round") if r["time"] <= t) for n, t in excluded_at.items()),
                          default=None)
    matchmaking = sorted(e.get("matchmaking_seconds", 0.0) for n in names for e in events(out, n, "round"))
    forged_catch_ups = sum(1 for n in names for e in events(out, n, "catch_up")
                           if e["digest"] not in honest_digests)
    return {
        "attack": attack,
        "honest_ce": sum(final_ce(out, n) for n in names) / len(names),
        "held_out_ce": sum(held_out_ce(out, n) for n in names) / len(names),
        "ok_rounds": sum(1 for n in names for e in events(out, n, "round") if e["status"] == "ok"),
        "rounds": sum(1 for n in names for e in events(out, n, "round")),
        "excluded_by": len(excluded_at),
        "first_exclusion_round": first_exclusion,
        "forged_catch_ups": forged_catch_ups,
        "hostile_lines": sum("HOSTILE:" in line for line in (out / "x.log").read_text(errors="replace").splitlines())
        if bad is not None else 0,
        "catch_ups": sum(len(events(out, n, "catch_up")) for n in names),
        "wall_seconds": wall,  # from the peers' start to the last honest peer's exit
        "matchmaking_median": matchmaking[len(matchmaking) // 2] if matchmaking else 0.0,
        "matchmaking_p90": matchmaking[int(0.9 * (len(matchmaking) - 1))] if matchmaking else 0.0,
        "absences": sum(len(events(out, n, "peer_absent")) for n in names),
        # the invariant: rounds whose honest appliers hold more than one digest after them
        "split_rounds": sum(len(set(d.values())) > 1 for d in applied_digests(out, names).values()),
    }


def run_attacks(attacks: list[str], run, out_dir: str, out: str | None) -> list[dict]:
    """``run(attack, its out dir)`` for each attack, clean first, with a progress line each; the rows are written
    as JSON to ``out`` (default OUT_DIR/results.json) and returned. (bench/lab_attacks.py uses it too.)"""
    attacks = ["clean"] + [a for a in attacks if a and a != "clean"]
    rows = []
    for attack in attacks:
        t0 = time.monotonic()
        rows.append(run(attack, Path(out_dir) / attack))
        print(f"  {attack:<15} honest CE {rows[-1]['honest_ce']:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
    path = Path(out or Path(out_dir) / "results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def ce_columns(rows: list[dict]) -> tuple[str, Callable[[dict], str]]:
    """The table's CE columns: the honest final CE and its change against ``clean`` (the first row) and, where an
    ``absent`` run is among them (the honest peers alone: what an attacker costs that brings no honest data and
    is ignored at once), against that. Returns their header and a row's cells."""
    clean = rows[0]["honest_ce"]
    absent = next((r["honest_ce"] for r in rows if r["attack"] == "absent"), None)
    held_clean = rows[0].get("held_out_ce")  # (bench/lab_attacks.py's rows have none)

    def cells(r: dict) -> str:
        out = f"{r['honest_ce']:.4f} | {100 * (r['honest_ce'] / clean - 1):+.2f}%"
        out = out if absent is None else out + f" | {100 * (r['honest_ce'] / absent - 1):+.2f}%"
        held = r.get("held_out_ce", math.nan)
        return out if held_clean is None else out + f" | {held:.4f} ({100 * (held / held_clean - 1):+.2f}%)"

    return ("honest final CE | vs clean" + (" | vs absent" if absent is not None else "")
            + (" | held-out CE of G (vs clean)" if held_clean is not None else "")), cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--honest", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--aggregator", default="clipped", help="the run's rule: clipped (default) or mean")
    ap.add_argument("--out-dir", default="runs/bench_swarm_attacks")
    ap.add_argument("--out", default=None, help="JSON results (default OUT_DIR/results.json)")
    ap.add_argument("--authority", action="store_true", help="authenticated runs: every peer holds a pass")
    args = ap.parse_args()
    EXTRA.extend(["--outer-aggregator", args.aggregator])
    if args.authority:
        from bootstrap.cli import main as bootstrap_main

        ca = Path(args.out_dir) / "authority"
        shutil.rmtree(ca, ignore_errors=True)
        made = in_process(bootstrap_main, "authority", "init", str(ca))
        assert made.returncode == 0, made.stderr
        AUTHORITY.append(ca)
        EXTRA.extend(["--authority", (ca / "authority.pub").read_text().strip()])
    attacks = ["clean"] + [a for a in args.attacks.split(",") if a and a != "clean"]
    print(f"{len(attacks)} runs: {args.honest} honest + 1 peer (honest in 'clean'), {args.steps} steps, "
          f"aggregator {args.aggregator}, {'authenticated' if args.authority else 'open'}, "
          f"{platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows = run_attacks(attacks, lambda attack, out: one_run(attack, args.honest, args.steps, out), args.out_dir,
                       args.out)
    header, ce_cells = ce_columns(rows)
    print(f"\n| attack | {header} | honest rounds ok | attacker excluded by | first at round "
          "| catch-ups (from a forged state) | forged actions | honest run (s) | matchmaking median / p90 (s) "
          "| absences noted | rounds split |")
    print("| --- " * (header.count("|") + 11) + "|")
    for r in rows:
        print(f"| {r['attack']} | {ce_cells(r)} | "
              f"{r['ok_rounds']}/{r['rounds']} | {r['excluded_by']}/{args.honest} | "
              f"{r['first_exclusion_round'] if r['first_exclusion_round'] is not None else '-'} | "
              f"{r['catch_ups']} ({r['forged_catch_ups']}) | {r['hostile_lines']} | {r['wall_seconds']:.0f} | "
              f"{r['matchmaking_median']:.1f} / {r['matchmaking_p90']:.1f} | {r['absences']} | "
              f"{r.get('split_rounds', '-')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
