"""Attacks on a peer's resources from a host of the attacker's own (issue 28), in a netns lab (tests/netns.py).

    .venv/bin/python bench/lab_attacks.py                    # every attack below: ~8 min, as root
    .venv/bin/python bench/lab_attacks.py --attacks stream_hog
    .venv/bin/python bench/lab_attacks.py --attacks key_fill2 --steps 240 --late-at 40   # clean2, key_fill2

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

A late joiner (``clean2``, ``key_fill2``; their own table, clean2 first): the honest peers on hosts 1..``--honest``,
one more honest peer on the next host that starts only once an honest peer logged step ``--late-at`` (and, in
``key_fill2``, every attacker's nodes store), in client mode (a volunteer behind a NAT: its DHT node holds nothing
for others, so its record lives only where the others' nodes keep it, as a newcomer's does in a swarm of more
nodes than a key's 5 replicas); in ``key_fill2`` two attacker hosts after it, each running bench/hostile_peer.py
``host_fill`` (48 sybil records of ~47 KB and 100 of ~950 bytes, from its peer's DHT node and 4 more on its host:
one host's nodes hold at most 2 MiB at another node, so two fill the 3.75 MiB progress key at every node), in
client mode too (every node that keeps records is an honest one's or the bootstrap's) and paused (outside their
active hours: they train nothing, and their sybils' records say paused: no rule counts them); ``clean2`` has no
attacker host. Every peer of these runs reads and publishes
its record every 3 s and trains a quarter of the time (``LATE_FLAGS``). Besides the columns above: the late
peer's rounds that ended ok with the honest peers (an honest peer applied the same digest in that round: one
group), the time from its start to the first, its final CE, and what a key probe on host 0 (a client-mode DHT
node reading each node's copy of the progress key every ``PROBE_PERIOD`` s, ``probe.jsonl``) saw from two probe
periods after the late peer's start: at how many nodes the key was full (less room than the smallest record) and
held the late peer's record (medians over the samples). A run is stopped when the machine has less than
``MIN_AVAILABLE`` memory left (said in its note).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from helpers import Proc, events, poll_pause  # noqa: E402
from netns import NetnsLab, netns_available, start_lab_swarm  # noqa: E402
from swarm_attacks import ce_columns, final_ce, run_attacks  # noqa: E402
from test_swarm import FAST, wait_exit  # noqa: E402

ATTACKS = ["clean", "absent", "stream_hog", "record_flood", "key_fill"]
LATE_ATTACKS = ["clean2", "key_fill2"]  # with a late joiner (their own table)
FILL_HOSTS = 2  # key_fill2's attacker hosts
LATE_WAIT = 600.0  # at most this long (s) for the late peer's cue; it starts then anyway
PROBE_PERIOD = 8.0  # seconds between two reads of every node's copy of the progress key
# clean2, key_fill2: every peer reads the progress key every 3 s, not 1 (FAST): a read of full keys costs each
# reader ~0.1 s of CPU per node, at 7 nodes more than this 2-core machine has for 6 readers at 1 s; and trains 25%
# of the time (--limits-duty-cycle, as a volunteer may ask): a clean run then lasts long enough for the late peer to
# meet the others, and under key_fill2 the training leaves CPU to the DHT processes
LATE_FLAGS = ["--progress-period", "3", "--progress-ttl", "24", "--limits-duty-cycle", "25"]
# a late-joiner run is stopped (every process killed) when the machine has less memory available than this: under
# key_fill2 an honest peer's DHT process grows by GBs (4.7 GB when the kernel killed one, 5 min into a run)
MIN_AVAILABLE = 2 << 30


def mem_available() -> int:
    """The machine's available memory (bytes, /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks so far of one process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def machine_busy() -> float:
    """Seconds the machine's cores were busy so far (``/proc/stat``: all but idle and iowait), all cores together."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def process_kind(proc: Proc, pid: int) -> str:
    """``peer`` (the peer's own process), ``dht`` (a Python process it forked) or ``p2pd`` (a libp2p daemon)."""
    if pid == proc.pid:
        return "peer"
    stat = Path(f"/proc/{pid}/stat").read_text()
    return "p2pd" if "p2pd" in stat[stat.index("(") + 1:stat.rindex(")")] else "dht"


def tree_usage(proc: Proc) -> tuple[int, int, dict[str, int]]:
    """(resident bytes, open files, resident bytes by :func:`process_kind`) of ``proc``'s session: the peer and every
    process it started."""
    rss = files = 0
    kinds: Counter[str] = Counter()
    for pid in proc.session_pids():
        try:
            n = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            files += len(os.listdir(f"/proc/{pid}/fd"))
            kinds[process_kind(proc, pid)] += n
            rss += n
        except (OSError, IndexError, ValueError):  # it exited between the listing and the read
            pass
    return rss, files, dict(kinds)


class Sampler:
    """Peak :func:`tree_usage` of each honest peer and the CPU time of its processes (the last reading of each
    pid: the peer, its DHT process, its libp2p daemon), every ``period`` s until :meth:`stop` (its owner stops
    it)."""

    def __init__(self, peers: dict[str, Proc], period: float = 0.5):
        self.peers, self.period = peers, period
        self.peak = {n: (0, 0) for n in peers}
        self.kind_peak: dict[str, Counter[str]] = {n: Counter() for n in peers}  # (each kind's own peak)
        self.cpu: dict[str, dict[int, tuple[str, int]]] = {n: {} for n in peers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for n, proc in self.peers.items():
                rss, files, kinds = tree_usage(proc)
                self.peak[n] = (max(self.peak[n][0], rss), max(self.peak[n][1], files))
                for kind, used in kinds.items():
                    self.kind_peak[n][kind] = max(self.kind_peak[n][kind], used)
                for pid in proc.session_pids():
                    try:
                        self.cpu[n][pid] = (process_kind(proc, pid), cpu_ticks(pid))
                    except (OSError, ValueError, IndexError):  # it exited between the listing and the read
                        continue

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


def tear_down(sampler, procs: list, lab) -> None:
    """Stops the sampler, kills what is left of every process started, and removes the lab."""
    if sampler is not None:
        sampler.stop()
    for proc in procs:
        if proc.returncode is None or proc.session_pids():
            proc.kill_group(signal.SIGKILL)
    lab.close()


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
        tear_down(sampler, procs, lab)
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
        "peak_rss_by_kind": {k: max(sampler.kind_peak[n][k] for n in names) for k in ("peer", "dht", "p2pd")},
        "peak_files": max(sampler.peak[n][1] for n in names),
        "refused": sum(r for r, _ in refused),
        "host_budget": any(h for _, h in refused),
        "hostile_lines": sum("HOSTILE:" in line for line in (out / "x.log").read_text(errors="replace").splitlines())
        if attack != "absent" else 0,
        "wall_seconds": wall,
        "cpu_seconds": {k: sum(c[k] for c in cpu) / len(cpu) for k in cpu[0]},
    }


def late_run(attack: str, honest: int, steps: int, late_at: int, out: Path) -> dict:
    """One run with a late joiner (``clean2``, ``key_fill2``: the module docstring)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    procs: list = []
    attackers = FILL_HOSTS if attack == "key_fill2" else 0
    lab = NetnsLab(honest + 2 + attackers).create()
    flags = ["--max-steps", str(steps), *FAST, *LATE_FLAGS, "--log-every", "2"]
    late_host, sampler, late_cue = honest + 1, None, {}

    def peer(host: int, name: str, entry: list, min_peers: int, more: tuple = ()) -> Proc:
        run_dir = out / name
        cmd = [sys.executable, *entry, "run", "--config", str(REPO / "configs/demo.toml"), "--initial-peers",
               *initial, "--host-maddrs", f"/ip4/{lab.addr(host)}/tcp/0", "--run-dir", str(run_dir), "--log-json",
               str(run_dir / "events.jsonl"), "--no-reachability-check", *flags, "--min-peers", str(min_peers), *more]
        procs.append(Proc.start(lab.run_args(host, cmd), log_path=out / f"{name}.log", cwd=REPO))
        return procs[-1]

    low = {"min_available": mem_available(), "stopped": False}
    done = threading.Event()

    def watch_memory() -> None:  # (the kernel would kill one process at random, ours or another session's)
        while not done.wait(0.5):
            low["min_available"] = min(low["min_available"], mem_available())
            if low["min_available"] < MIN_AVAILABLE and not low["stopped"]:
                low["stopped"] = True
                print(f"  ({attack}: {low['min_available'] / 2**30:.1f} GiB of memory left: stopping the run)",
                      flush=True)
            for proc in list(procs) if low["stopped"] else ():
                if proc.returncode is None:
                    proc.kill_group(signal.SIGKILL)

    watcher = threading.Thread(target=watch_memory, name="memory", daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        _, initial, peers = start_lab_swarm(lab, procs, out, [flags + ["--min-peers", str(honest)]] * honest)
        idle = time.localtime(time.time() + 6 * 3600)  # (the attackers train nothing: outside their active hours)
        flags_x = ["--limits-active-hours", f"{idle.tm_hour:02d}:00-{(idle.tm_hour + 1) % 24:02d}:00", "--client-mode"]
        bad = [peer(late_host + 1 + i, f"x{i + 1}", [str(REPO / "bench" / "hostile_peer.py"), "host_fill"], honest,
                    flags_x) for i in range(attackers)]
        procs.append(Proc.start(lab.run_args(0, [sys.executable, str(Path(__file__).resolve()), "--key-probe", str(out),
                                                 "--initial-peers", *initial]), log_path=out / "probe.log", cwd=REPO))
        sampler = Sampler({**peers, **{f"x{i + 1}": x for i, x in enumerate(bad)}})  # (the attackers: CPU only)
        busy0 = machine_busy()

        def cue() -> bool:  # an honest peer at step late_at, every attacker's nodes up (or someone exited)
            at = max((e["step"] for n in peers for e in events(out, n, "step")[-1:]), default=0)
            up = all(any("more DHT nodes" in line for line in x.lines()) for x in bad)
            return (at >= late_at and up) or any(p.returncode is not None for p in [*peers.values(), *bad])

        started = time.monotonic()
        while not cue() and time.monotonic() - started < LATE_WAIT:
            poll_pause(started)
        late_cue = {"waited_seconds": time.monotonic() - started, "cue_met": cue(),
                    "honest_step": max((e["step"] for n in peers for e in events(out, n, "step")[-1:]), default=0)}
        late = None if low["stopped"] else peer(late_host, "late", ["-m", "peer"], honest + 1, ["--client-mode"])
        exits = [wait_exit(proc, 900) for proc in peers.values()]
        wall = time.monotonic() - t0
        busy = machine_busy() - busy0
        try:
            late_exit = None if late is None else wait_exit(late, 300)
        except TimeoutError:
            late_exit = None  # (killed below)
    finally:
        done.set()
        watcher.join(timeout=5)
        tear_down(sampler, procs, lab)
    names = list(peers)
    cpu = [sampler.cpu_seconds(n) for n in names]
    honest_ok = {(e["fragment"], e["round"], e["digest"]) for n in names for e in events(out, n, "round")
                 if e["status"] == "ok"}
    late_rounds = events(out, "late", "round")
    late_ok = [e for e in late_rounds if e["status"] == "ok"]
    shared = [e for e in late_ok if (e["fragment"], e["round"], e["digest"]) in honest_ok]
    shared_keys = {(e["fragment"], e["round"], e["digest"]) for e in shared}
    start = events(out, "late", "start")
    return {
        "attack": attack,
        "honest_failed": sum(1 for code in exits if code != 0),
        "late_exit": late_exit,
        "late_cue": late_cue,
        "stopped_for_memory": low["stopped"],
        "min_available": low["min_available"],
        "honest_ce": sum(final_ce(out, n) for n in names) / len(names),
        "ok_rounds": sum(1 for n in names for e in events(out, n, "round") if e["status"] == "ok"),
        "rounds": sum(1 for n in names for e in events(out, n, "round")),
        "honest_ok_with_late": sum(1 for n in names for e in events(out, n, "round")
                                   if e["status"] == "ok" and (e["fragment"], e["round"], e["digest"]) in shared_keys),
        "late_rounds": len(late_rounds),
        "late_ok": len(late_ok),
        "late_shared": len(shared),
        "late_statuses": dict(sorted(Counter(e["status"] for e in late_rounds).items())),
        "late_group_sizes": dict(sorted(Counter(e["group_size"] for e in late_ok).items())),
        "late_first_shared": min(e["time"] for e in shared) - start[0]["time"] if shared and start else None,
        "late_ce": final_ce(out, "late"),
        "late_catch_ups": len(events(out, "late", "catch_up")),
        "probe": probe_summary(out, start[0]["time"] if start else None),
        "peak_rss": max(sampler.peak[n][0] for n in names),
        "peak_rss_by_kind": {k: max(sampler.kind_peak[n][k] for n in names) for k in ("peer", "dht", "p2pd")},
        "hostile_lines": sum("HOSTILE:" in line for i in range(attackers)
                             for line in (out / f"x{i + 1}.log").read_text(errors="replace").splitlines()),
        "wall_seconds": wall,
        "cpu_seconds": {k: sum(c[k] for c in cpu) / len(cpu) for k in cpu[0]},
        # where the machine's CPU went from the attackers' start to the honest peers' exit: every honest peer's
        # processes, every attacker's, and the machine's busy seconds (all its cores) in that time
        "cpu_split": {"honest": sum(sum(c.values()) for c in cpu),
                      "attackers": sum(sum(sampler.cpu_seconds(f"x{i + 1}").values()) for i in range(attackers)),
                      "machine": busy, "cores": os.cpu_count()},
    }


def probe_summary(out: Path, late_start: float | None) -> dict:
    """What the key probe saw after the late peer's start (+ 2 probe periods, so that its record could be stored):
    medians over the samples of the nodes whose key was full and of those that held the late peer's record, of all
    it read."""
    from peer.net.plumbing.dht_storage import BOUNDS

    path = out / "probe.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    samples = [json.loads(line) for line in lines if line.endswith("}")]
    if late_start is not None:
        samples = [s for s in samples if s["time"] >= late_start + 2 * PROBE_PERIOD]
    if not samples:
        return {"samples": 0}

    def median(xs: list) -> float:
        return sorted(xs)[len(xs) // 2]

    full = BOUNDS.max_key_bytes - FULL_SLACK
    return {"samples": len(samples), "nodes": median([len(s["nodes"]) for s in samples]),
            "full": median([sum(n["bytes"] > full for n in s["nodes"]) for s in samples]),
            "late_held": median([sum("late" in n["held"] for n in s["nodes"]) for s in samples])}


FULL_SLACK = 1024  # a key with less room than this is full: the smallest record with its subkey is ~950 bytes


async def _key_holdings(_dht, node, key: str, timeout: float) -> list[dict]:
    """(In the probe's DHT process) every node near ``key``, nearest first: its peer id, whether it answered, and
    what it answered for the key (its storage's or its cache's copy: bytes as a storage counts them; each entry's
    record's peer id)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    key_id = DHTID.generate(source=key)
    nearest = (await node.find_nearest_nodes([key_id], k_nearest=32, exclude_self=True))[key_id]
    ser, validator, out = node.protocol.serializer, node.protocol.record_validator, []
    for node_id, peer_id in nearest.items():
        try:
            found = await asyncio.wait_for(node.protocol.call_find(peer_id, [key_id]), timeout)
        except Exception:
            found = None
        value = (found or {}).get(key_id, (None, None))[0]
        held, size = [], 0
        for subkey, (data, expiration) in value.value.items() if value is not None else ():
            size += len(data) + (len(subkey) if isinstance(subkey, (bytes, str)) else 16) + 64
            try:
                record = DHTRecord(key_id.to_bytes(), ser.dumps(subkey), data, expiration)
                rec = ser.loads(validator.strip_value(record))
                held.append(rec.get("peer_id") if isinstance(rec, dict) else None)
            except Exception:
                held.append(None)
        out.append({"peer_id": str(peer_id), "answered": found is not None, "bytes": size, "ids": held})
    return out


def key_probe(out: Path, initial: list[str]) -> int:
    """``--key-probe``: a client-mode DHT node that reads every node's copy of the run's progress key every
    PROBE_PERIOD s (the run's key from the first honest peer's start event) and appends what it saw to
    ``out/probe.jsonl``, the names of the peers (their start events) whose records each held; runs until killed."""
    from peer.net.plumbing.dht import create_dht
    from peer.net.swarm import swarm_key
    from peer.net.trust.progress import make_validators, progress_key

    start = []
    deadline = time.monotonic() + 120
    while not start and time.monotonic() < deadline:
        start = events(out, "p1", "start")
        time.sleep(1.0)
    if not start:
        print("key probe: no start event of p1 within 120 s", flush=True)
        return 1
    cfg = start[0]["config"]
    run_key = swarm_key(cfg["swarm"]["run_id"], start[0]["run_hash"], cfg["outer"]["codec"])
    key, host = progress_key(run_key), initial[0].split("/tcp/")[0]
    dht = create_dht(initial_peers=initial, host_maddrs=[f"{host}/tcp/0"], announce_maddrs=[], identity_path=None,
                     client_mode=True, record_validators=make_validators(run_key)[0])
    boot = initial[0].split("/p2p/")[-1]
    with open(out / "probe.jsonl", "a") as f:
        while True:
            t0 = time.monotonic()
            names = {boot: "boot"}
            for d in sorted(p for p in out.iterdir() if (p / "events.jsonl").exists()):
                names.update({e["peer_id"]: d.name for e in events(out, d.name, "start")})
            try:
                nodes = dht.run_coroutine(functools.partial(_key_holdings, key=key, timeout=PROBE_PERIOD),
                                          return_future=True).result(4 * PROBE_PERIOD)
            except Exception as e:
                print(f"key probe: {type(e).__name__}: {e}", flush=True)
                nodes = []
            line = {"time": time.time(), "nodes": [
                {"name": names.get(n["peer_id"], n["peer_id"][-8:]), "rank": i + 1, "answered": n["answered"],
                 "bytes": n["bytes"], "entries": len(n["ids"]),
                 "held": sorted({names[p] for p in n["ids"] if p in names})} for i, n in enumerate(nodes)]}
            f.write(json.dumps(line) + "\n")
            f.flush()
            time.sleep(max(0.0, PROBE_PERIOD - (time.monotonic() - t0)))


def late_table(rows: list[dict]) -> None:
    """The late-joiner rows' table (clean2 first: the CE reference)."""
    clean = rows[0]["honest_ce"]
    print("\n| run | honest final CE | vs clean2 | honest rounds ok | honest ok rounds with the late peer "
          "| late peer: rounds ok with the honest / ok / all | late peer: start to first round with the honest (s) "
          "| late peer final CE | key probe after its start: nodes with the key full / with its record / of "
          "| forged actions | peak memory of a peer (GiB) | its peak by process: peer / DHT / p2pd (GiB) "
          "| honest run (s) | CPU s of a peer: peer / DHT / p2pd |")
    print("| --- " * 14 + "|")
    for r in rows:
        c, p = r["cpu_seconds"], r["probe"]
        first = "—" if r["late_first_shared"] is None else f"{r['late_first_shared']:.0f}"
        seen = (f"{p['full']} / {p['late_held']} / {p['nodes']}" if p.get("samples") else "no samples")
        by_kind = " / ".join(f"{r['peak_rss_by_kind'][k] / 2**30:.2f}" for k in ("peer", "dht", "p2pd"))
        print(f"| {r['attack']} | {r['honest_ce']:.4f} | {100 * (r['honest_ce'] / clean - 1):+.2f}% "
              f"| {r['ok_rounds']}/{r['rounds']} | {r['honest_ok_with_late']} "
              f"| {r['late_shared']} / {r['late_ok']} / {r['late_rounds']} | {first} | {r['late_ce']:.4f} "
              f"| {seen} | {r['hostile_lines']} | {r['peak_rss'] / 2**30:.2f} "
              f"| {by_kind} "
              f"| {r['wall_seconds']:.0f} | {c['peer']:.0f} / {c['dht']:.0f} / {c['p2pd']:.0f} |")
    for r in rows:
        print(f"({r['attack']}: the late peer started {r['late_cue']['waited_seconds']:.0f} s after the cue's wait "
              f"began, an honest peer at step {r['late_cue']['honest_step']}"
              f"{'' if r['late_cue']['cue_met'] else ' (cue not met: started anyway)'}; its rounds "
              f"{r['late_statuses']}, group sizes of its ok rounds {r['late_group_sizes']}, catch-ups "
              f"{r['late_catch_ups']}, exit {r['late_exit']}; {r['honest_failed']} honest peer(s) failed; "
              f"probe samples {r['probe'].get('samples', 0)}; least memory available "
              f"{r['min_available'] / 2**30:.1f} GiB{' (STOPPED for memory)' if r['stopped_for_memory'] else ''}; "
              f"CPU s from the attackers' start: honest peers {r['cpu_split']['honest']:.0f}, attackers "
              f"{r['cpu_split']['attackers']:.0f}, the machine {r['cpu_split']['machine']:.0f} of "
              f"{r['cpu_split']['cores']} cores x {r['wall_seconds']:.0f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--honest", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="(the attacker's 34 daemons take ~10 s to start)")
    ap.add_argument("--out-dir", default="runs/bench_lab_attacks")
    ap.add_argument("--out", default=None, help="JSON results (default OUT_DIR/results.json)")
    ap.add_argument("--late-at", type=int, default=None, help="clean2, key_fill2: the honest step at which the late "
                    "peer starts (default: a quarter of --steps)")
    ap.add_argument("--key-probe", default=None, help=argparse.SUPPRESS)  # (the key probe's process: OUT_DIR)
    ap.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.key_probe:
        return key_probe(Path(args.key_probe), args.initial_peers)
    ok, why = netns_available()
    if not ok:
        print(f"lab_attacks: {why}", file=sys.stderr)
        return 2
    asked = [a for a in args.attacks.split(",") if a]
    late = ["clean2"] + [a for a in asked if a in LATE_ATTACKS and a != "clean2"] if set(asked) & set(LATE_ATTACKS) \
        else []
    attacks = ["clean"] + [a for a in asked if a != "clean" and a not in LATE_ATTACKS] \
        if "clean" in asked or set(asked) - set(LATE_ATTACKS) else []
    late_at = args.steps // 4 if args.late_at is None else args.late_at
    print(f"{len(attacks) + len(late)} runs: {args.honest} honest + 1 peer (honest in 'clean') on hosts of their "
          f"own, {args.steps} steps{f'; the late peer at step {late_at}' if late else ''}, {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows = run_attacks(attacks, lambda attack, out: one_run(attack, args.honest, args.steps, out), args.out_dir,
                       args.out) if attacks else []
    late_rows = []
    for attack in late:
        t0 = time.monotonic()
        late_rows.append(late_run(attack, args.honest, args.steps, late_at, Path(args.out_dir) / attack))
        r = late_rows[-1]
        print(f"  {attack:<15} honest CE {r['honest_ce']:.4f}, late peer {r['late_shared']}/{r['late_rounds']} "
              f"rounds ok with the honest ({time.monotonic() - t0:.0f} s)", flush=True)
    if late_rows:
        path = Path(args.out or Path(args.out_dir) / "results.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows + late_rows, indent=1))
        late_table(late_rows)
    if not rows:
        return 0
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
