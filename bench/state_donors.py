"""A joiner's state download from 1 against 3 donors on shaped links (issue 16).

    sudo .venv/bin/python bench/state_donors.py [--donor-mbit 20] [--elements 4000000] [--repeats 2]

Builds a network lab (``tests/netns.py``) of four hosts: three donors in hosts 1-3, each link shaped to
``--donor-mbit`` in both directions (``tc tbf``), and the joiner in host 0, unshaped. Each donor is a process that
serves one fragment's state (``G, v`` of ``--elements`` fp32 each, the same seed everywhere, so the same digest)
with ``peer.net.state_transfer.StateServicer``. The joiner downloads it with :func:`peer.net.state_transfer.download`
and ``parallel`` 1 and 3, alternating, ``--repeats`` times each, and prints the seconds and the rate of each, and
the speed-up of 3 donors over 1 (the goal: close to 3 while the donors' links bind). Every download is verified
block by block against the digest. Needs root; every process and namespace it starts is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from netns import NetnsLab, netns_available  # noqa: E402

from peer.config import MBIT  # noqa: E402

CHUNK_ELEMS = 1 << 16  # elements per message (512 KiB of G and v): the swarm's default chunk_bytes // 8 is 128K


def state(elements: int):
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(elements, generator=g), torch.randn(elements, generator=g)


async def serve(addr: str, elements: int) -> None:
    """A donor: serves the seeded state at ``addr`` until stdin closes; prints its multiaddr first."""
    from hivemind.p2p import P2P

    from peer.net.flow.streams import StreamGuard
    from peer.net.state_transfer import ServedState, StateServicer
    from peer.outer.state import digest_of

    G, v = state(elements)
    p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/0"], nat_port_map=False)
    servicer = StateServicer(CHUNK_ELEMS, guard=StreamGuard(per_peer=8, total=64), request_timeout=10,
                             stream_timeout=600, max_uploads=4)
    servicer.publish(ServedState(0, 1, 10, G, v, digest_of(G, v)))
    await servicer.add_p2p_handlers(p2p)
    maddr = [str(m).split("/p2p/")[0] for m in await p2p.get_visible_maddrs() if addr in str(m)][0]
    print(f"{maddr}/p2p/{p2p.peer_id}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await p2p.shutdown()


async def fetch(addr: str, donors: list[str], elements: int, parallels: list[int], repeats: int) -> list[tuple]:
    """The joiner: downloads from the donors with each ``parallel`` in turn; returns (parallel, seconds)."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from peer.net.state_transfer import download
    from peer.outer.state import digest_of

    G, v = state(elements)
    digest = digest_of(G, v)
    p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/0"], nat_port_map=False)
    try:
        ids = []
        for text in donors:
            maddr = Multiaddr(text)
            pid = PeerID.from_base58(maddr.value_for_protocol("p2p"))
            await p2p._client.connect(pid, [maddr.decapsulate(f"/p2p/{pid}")])
            ids.append(pid)
        out = []
        for _ in range(repeats):
            for parallel in parallels:
                t0 = time.monotonic()
                got = await download(p2p, ids, 0, round_=1, numel=elements, digest=digest, timeout_per_donor=600,
                                     max_chunk_elems=CHUNK_ELEMS, parallel=parallel)
                out.append((parallel, time.monotonic() - t0))
                assert got.digest == digest
        return out
    finally:
        await p2p.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--donor-mbit", type=float, default=20.0)
    ap.add_argument("--elements", type=int, default=4_000_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)  # internal: a donor at this address
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.elements))
        return 0
    ok, why = netns_available()
    if not ok:
        print(f"bench/state_donors.py: {why}", file=sys.stderr)
        return 2
    donors: list[subprocess.Popen] = []
    try:
        with NetnsLab(4) as lab:
            for i in (1, 2, 3):
                lab.shape(i, args.donor_mbit)
                donors.append(subprocess.Popen(lab.run_args(i, [sys.executable, __file__, "--serve", lab.addr(i),
                                                                "--elements", str(args.elements)]),
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO))
            maddrs = [d.stdout.readline().strip() for d in donors]  # (each prints its address once it serves)
            assert all("/p2p/" in m for m in maddrs), maddrs
            joiner = subprocess.run(lab.run_args(0, [sys.executable, "-c", (
                "import asyncio, json, sys; sys.path.insert(0, 'bench'); import state_donors as s; "
                f"print(json.dumps(asyncio.run(s.fetch({lab.addr(0)!r}, {maddrs!r}, {args.elements}, [1, 3], "
                f"{args.repeats}))))")]), capture_output=True, text=True, cwd=REPO, timeout=1800)
            if joiner.returncode != 0:
                print(joiner.stderr[-3000:], file=sys.stderr)
                return 1
            import json

            runs = json.loads(joiner.stdout.strip().splitlines()[-1])
    finally:
        for d in donors:
            if d.stdin:
                d.stdin.close()
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
    nbytes = 8 * args.elements
    print(f"bench/state_donors.py --donor-mbit {args.donor_mbit:g} --elements {args.elements} --repeats "
          f"{args.repeats}: {nbytes / 1e6:.0f} MB of state (G and v), donors' links {args.donor_mbit:g} Mbit/s")
    print("| donors | seconds (each run) | median s | rate (Mbit/s) | of one donor's link |")
    print("| --- | --- | --- | --- | --- |")
    med = {}
    for parallel in (1, 3):
        secs = [s for p, s in runs if p == parallel]
        med[parallel] = statistics.median(secs)
        rate = nbytes / med[parallel] / MBIT
        print(f"| {parallel} | {', '.join(f'{s:.1f}' for s in secs)} | {med[parallel]:.1f} | {rate:.1f} "
              f"| {rate / args.donor_mbit:.2f}x |")
    print(f"speed-up of 3 donors over 1: {med[1] / med[3]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
