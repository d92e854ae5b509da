"""Attacks on a peer's resources from a host of the attacker's own (issue 28), in a netns lab (tests/netns.py).

    .venv/bin/python bench/lab_attacks.py                    # every attack below: ~8 min, as root
    .venv/bin/python bench/lab_attacks.py --attacks stream_hog

Host 0 runs the bootstrap node, hosts 1..``--honest`` the honest peers, the last host one more peer: honest in
``clean``, none in ``absent`` (what an attacker whose own rounds fail costs: its data), bench/hostile_peer.py
otherwise (``stream_hog``: 34 more identities on its host holding streams;
``record_flood``: 40 records of 1 MiB at every beat; ``key_fill``: 90 valid sybil records of ~45 KB, past what a
key holds). Each peer listens on its own host's address, so the
per-host stream budget (``swarm.max_streams_per_host``) sees the attacker's identities as one host, as it would
on the internet; on loopback every peer counts alone. The settings of bench/swarm_attacks.py (tiny preset,
seq 32 x batch 4, H = 20, 2 fragments), ``--steps`` steps (400).

Prints one table (and writes ``--out``, JSON): per attack, the honest peers' final training CE against the clean
run (and the ``absent`` one, where it ran), their rounds that ended ok, the largest resident memory and open files
of one honest peer (its processes together: the peer, its DHT process, its libp2p daemon; sampled every 0.5 s), the
streams the honest peers refused (their logs' last count) and whether any refusal was the per-host budget's, and
the attacker's forged actions (its ``HOSTILE:`` lines).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from helpers import Proc, events  # noqa: E402
from netns import NetnsLab, netns_available, start_lab_swarm  # noqa: E402
from swarm_attacks import ce_columns, final_ce, run_attacks  # noqa: E402
from test_swarm import FAST, wait_exit  # noqa: E402

ATTACKS = ["clean", "absent", "stream_hog", "record_flood", "key_fill"]
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> tuple[str, int]:
    """(``p2pd`` or ``python``, user + system clock ticks so far) of one process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return ("p2pd" if "p2pd" in name else "python"), int(fields[11]) + int(fields[12])


def tree_usage(proc: Proc) -> tuple[int, int]:
    """(resident bytes, open files) of ``proc``'s session: the peer and every process it started."""
    rss = files = 0
    for pid in proc.session_pids():
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            files += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, IndexError, ValueError):  # it exited between the listing and the read
            pass
    return rss, files


class Sampler:
    """Peak :func:`tree_usage` of each honest peer and the CPU time of its processes (the last reading of each
    pid: the peer, its DHT process, its libp2p daemon), every ``period`` s until :meth:`stop` (its owner stops
    it)."""

    def __init__(self, peers: dict[str, Proc], period: float = 0.5):
        self.peers, self.period = peers, period
        self.peak = {n: (0, 0) for n in peers}
        self.cpu: dict[str, dict[int, tuple[str, int]]] = {n: {} for n in peers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for n, proc in self.peers.items():
                rss, files = tree_usage(proc)
                self.peak[n] = (max(self.peak[n][0], rss), max(self.peak[n][1], files))
                for pid in proc.session_pids():
                    try:
                        kind, ticks = cpu_ticks(pid)
                    except (OSError, ValueError, IndexError):  # it exited between the listing and the read
                        continue
                    if pid == proc.pid:
                        kind = "peer"
                    elif kind == "python":
                        kind = "dht"  # the peer's forked DHT process
                    self.cpu[n][pid] = (kind, ticks)

    def cpu_seconds(self, name: str) -> dict[str, float]:
        """CPU seconds of one honest peer's processes, by kind (``peer``, ``dht``, ``p2pd``)."""
        out: dict[str, float] = {"peer": 0.0, "dht": 0.0, "p2pd": 0.0}
        for kind, ticks in self.cpu[name].values():
            out[kind] = out.get(kind, 0.0) + ticks / TICK
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def refusals(log_text: str) -> tuple[int, bool]:
    """(the last "N refused so far" count, whether a refusal named the host's budget) of one peer's log."""
    counts = [int(m) for m in re.findall(r"(\d+) refused so far", log_text)]
    return (counts[-1] if counts else 0), "from this peer's host" in log_text


def one_run(attack: str, honest: int, steps: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # (the logs and events are appended to: an earlier run's would count)
    out.mkdir(parents=True)
    procs: list = []
    lab = NetnsLab(honest + 2).create()
    size = honest if attack == "absent" else honest + 1
    flags = ["--max-steps", str(steps), "--min-peers", str(size), *FAST, "--log-every", "2"]
    sampler = None
    try:
        t0 = time.monotonic()
        _, initial, peers = start_lab_swarm(lab, procs, out, [flags] * honest)
        host, run_dir = honest + 1, out / "x"
        entry = ["-m", "peer"] if attack == "clean" else [str(REPO / "bench" / "hostile_peer.py"), attack]
        cmd = [sys.executable, *entry, "run", "--config", str(REPO / "configs/demo.toml"), "--initial-peers",
               *initial, "--host-maddrs", f"/ip4/{lab.addr(host)}/tcp/0", "--run-dir", str(run_dir), "--log-json",
               str(run_dir / "events.jsonl"), "--no-reachability-check", *flags]
        if attack != "absent":
            procs.append(Proc.start(lab.run_args(host, cmd), log_path=out / "x.log", cwd=REPO))
        sampler = Sampler(peers)
        exits = [wait_exit(proc, 900) for proc in peers.values()]
        wall = time.monotonic() - t0
    finally:
        if sampler is not None:
            sampler.stop()
        for proc in procs:
            if proc.returncode is None or proc.session_pids():
                proc.kill_group(signal.SIGKILL)
        lab.close()
    names = list(peers)
    cpu = [sampler.cpu_seconds(n) for n in names]
    refused = [refusals((out / f"{n}.log").read_text(errors="replace")) for n in names]
    return {
        "attack": attack,
        "honest_failed": sum(1 for code in exits if code != 0),  # honest peers that exited with an error
        "honest_ce": sum(final_ce(out, n) for n in names) / len(names),
        "ok_rounds": sum(1 for n in names for e in events(out, n, "round") if e["status"] == "ok"),
        "rounds": sum(1 for n in names for e in events(out, n, "round")),
        "peak_rss": max(sampler.peak[n][0] for n in names),
        "peak_files": max(sampler.peak[n][1] for n in names),
        "refused": sum(r for r, _ in refused),
        "host_budget": any(h for _, h in refused),
        "hostile_lines": sum("HOSTILE:" in line for line in (out / "x.log").read_text(errors="replace").splitlines())
        if attack != "absent" else 0,
        "wall_seconds": wall,
        "cpu_seconds": {k: sum(c[k] for c in cpu) / len(cpu) for k in cpu[0]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--honest", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="(the attacker's 34 daemons take ~10 s to start)")
    ap.add_argument("--out-dir", default="runs/bench_lab_attacks")
    ap.add_argument("--out", default=None, help="JSON results (default OUT_DIR/results.json)")
    args = ap.parse_args()
    ok, why = netns_available()
    if not ok:
        print(f"lab_attacks: {why}", file=sys.stderr)
        return 2
    attacks = ["clean"] + [a for a in args.attacks.split(",") if a and a != "clean"]
    print(f"{len(attacks)} runs: {args.honest} honest + 1 peer (honest in 'clean') on hosts of their own, "
          f"{args.steps} steps, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows = run_attacks(attacks, lambda attack, out: one_run(attack, args.honest, args.steps, out), args.out_dir,
                       args.out)
    header, ce_cells = ce_columns(rows)
    print(f"\n| attack | {header} | honest rounds ok | peak memory of a peer (GiB) "
          "| peak open files of a peer | streams refused (per-host budget) | forged actions | honest run (s) "
          "| CPU s of a peer: peer / DHT / p2pd |")
    print("| --- " * (header.count("|") + 9) + "|")
    for r in rows:
        c = r["cpu_seconds"]
        print(f"| {r['attack']} | {ce_cells(r)} | "
              f"{r['ok_rounds']}/{r['rounds']} | {r['peak_rss'] / 2**30:.2f} | {r['peak_files']} | "
              f"{r['refused']} ({'yes' if r['host_budget'] else 'no'}) | {r['hostile_lines']} | "
              f"{r['wall_seconds']:.0f} | {c['peer']:.0f} / {c['dht']:.0f} / {c['p2pd']:.0f} |")
    for r in rows:
        if r["honest_failed"]:
            print(f"({r['attack']}: {r['honest_failed']} honest peer(s) exited with an error: their logs are in "
                  f"{Path(args.out_dir) / r['attack']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
