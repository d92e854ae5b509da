"""A capped peer's measured rate against its cap, in a swarm over real links (issue 15).

    sudo .venv/bin/python bench/bandwidth.py [--upload-mbps 8] [--download-mbps 12] [--seconds 120]

Builds a network lab (``tests/netns.py``: Linux network namespaces on a private bridge, 10.77.0.0/24, nothing
routed outside it), a bootstrap node in host 0 and three peers in hosts 1-3. Peer 3 runs with
``--limits-upload-mbps`` and ``--limits-download-mbps``; the others are uncapped. The peers train the tiny preset as one
fragment with fp32 on the wire, so every round moves ~6 MB each way per peer: seconds at the caps.

While they train, the script samples host 3's interface counters (``ip -s -j link``, every ``POLL`` s: what really
crossed the link, TCP/IP and libp2p framing, acknowledgements and the DHT included) and reports, per direction, the
rate while the peer was moving data: the bytes of its busy stretches (sampling intervals above a third of the cap,
short idle gaps between paced messages bridged, the first and last interval of each stretch dropped as partial) over
their duration, and its ratio to the cap. The goal: within 10% of the cap. The same figure for an uncapped peer (its
streams to peer 3 are paced to peer 3's declared download cap, the others are not) shows that the cap is what binds.
It also counts the rounds the three completed together (status ok, group of 3, one digest), as the swarm must keep
completing rounds with the capped peer. Needs root. Every process and namespace it starts is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import events, wait_for  # noqa: E402
from netns import HOST_IF, NetnsLab, netns_available, start_lab_swarm  # noqa: E402

from peer.config import MBIT  # noqa: E402

POLL = 0.25
FLAGS = ["--model-seq-len", "32", "--data-batch-size", "4", "--outer-sync-every", "20", "--outer-fragment-blocks",
         "6", "--outer-codec", "fp32", "--matchmaking-time", "6", "--matchmaking-timeout", "30",
         "--request-timeout", "3", "--allreduce-timeout", "60", "--part-timeout", "40", "--chunk-bytes", "65536",
         "--progress-period", "2", "--progress-ttl", "15", "--status-interval", "0", "--inner-threads", "1",
         "--min-peers", "3", "--start-timeout", "120", "--max-steps", "1000000"]


def counters(lab: NetnsLab, host: int) -> tuple[int, int]:
    """(tx, rx) bytes of host ``host``'s interface."""
    out = subprocess.run(["ip", "-n", lab.host(host), "-s", "-j", "link", "show", "dev", HOST_IF],
                         capture_output=True, text=True, check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def busy_rate(samples: list[tuple[float, int]], threshold: float, bridge: int = 2,
              min_seconds: float = 1.0) -> tuple[float, float]:
    """(bytes/s, seconds) over the peer's busy stretches: runs of sampling intervals above ``threshold`` bytes/s,
    with idle gaps of fewer than ``bridge`` intervals bridged (paced messages leave the host in bursts, one message
    at a time), each without its first and last busy interval (partial), at least ``min_seconds`` long."""
    intervals = [(t1 - t0, b1 - b0) for (t0, b0), (t1, b1) in zip(samples, samples[1:])]
    busy = [i for i, (dt, nb) in enumerate(intervals) if dt > 0 and nb / dt > threshold]
    stretches, start = [], 0
    for k in range(1, len(busy) + 1):
        if k == len(busy) or busy[k] - busy[k - 1] > bridge:
            stretches.append((busy[start], busy[k - 1]))
            start = k
    seconds = nbytes = 0.0
    for first, last in stretches:
        inner = intervals[first + 1:last]
        if sum(dt for dt, _ in inner) >= min_seconds:
            seconds += sum(dt for dt, _ in inner)
            nbytes += sum(nb for _, nb in inner)
    return (nbytes / seconds if seconds else 0.0), seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upload-mbps", type=float, default=8.0)
    ap.add_argument("--download-mbps", type=float, default=12.0)
    ap.add_argument("--seconds", type=float, default=120.0, help="how long to sample once all peers train")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/bench_bandwidth")
    args = ap.parse_args()
    ok, why = netns_available()
    if not ok:
        print(f"bench/bandwidth.py: {why}", file=sys.stderr)
        return 2
    import shutil

    shutil.rmtree(args.out_dir, ignore_errors=True)
    args.out_dir.mkdir(parents=True)
    capped = ["--limits-upload-mbps", str(args.upload_mbps), "--limits-download-mbps", str(args.download_mbps)]
    started: list = []
    samples: dict[int, list[tuple[float, int, int]]] = {1: [], 3: []}
    try:
        with NetnsLab(4) as lab:
            _, _, peers = start_lab_swarm(lab, started, args.out_dir, [FLAGS, FLAGS, FLAGS + capped])
            def training() -> bool:
                if exited := [n for n, p in peers.items() if p.popen.poll() is not None]:
                    raise RuntimeError(f"{exited} exited: {peers[exited[0]].tail(5)}")
                return all(events(args.out_dir, n, "step") for n in peers)

            wait_for(training, 240, "every peer to train")
            t_start, end = time.time(), time.monotonic() + args.seconds
            while time.monotonic() < end:
                for host in samples:
                    samples[host].append((time.monotonic(), *counters(lab, host)))
                if any(p.popen.poll() is not None for p in peers.values()):
                    raise RuntimeError("a peer exited: " + "; ".join(f"{n}: {p.tail(5)}" for n, p in peers.items()))
                time.sleep(POLL)  # (the sampling period, not a synchronization)
            codes = {n: p.terminate(timeout=60) for n, p in peers.items()}
            rounds = {n: {(e["fragment"], e["round"]): e for e in events(args.out_dir, n, "round")
                          if e["time"] >= t_start and e["status"] == "ok" and e["group_size"] == 3} for n in peers}
            together = set.intersection(*(set(r) for r in rounds.values()))
            agree = [k for k in together if len({rounds[n][k]["digest"] for n in peers}) == 1]
    finally:
        for p in reversed(started):
            if p.popen.poll() is None:
                p.kill_group(signal.SIGKILL)
    (args.out_dir / "samples.json").write_text(json.dumps({str(h): v for h, v in samples.items()}))
    print(f"bench/bandwidth.py --upload-mbps {args.upload_mbps:g} --download-mbps {args.download_mbps:g} "
          f"--seconds {args.seconds:g}; exit codes {codes}")
    print("| peer | direction | cap (Mbit/s) | measured while busy (Mbit/s) | busy s | measured / cap |")
    print("| --- | --- | --- | --- | --- | --- |")
    caps = {"upload": args.upload_mbps, "download": args.download_mbps}
    for host, name in ((3, "p3 (capped)"), (1, "p1 (uncapped)")):
        for k, direction in ((1, "upload"), (2, "download")):
            series = [(s[0], s[k]) for s in samples[host]]
            rate, busy_s = busy_rate(series, caps[direction] * MBIT / 3)
            cap = caps[direction] if host == 3 else 0.0
            ratio = f"{rate / (cap * MBIT):.3f}" if cap else "-"
            print(f"| {name} | {direction} | {cap or 'none'} | {rate / MBIT:.2f} | {busy_s:.1f} | {ratio} |")
    print(f"rounds the three completed together after the start of sampling: {len(together)}, with one digest: "
          f"{len(agree)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
