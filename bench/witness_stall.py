"""How long a round's claims witness holds the round up after its all-reduce, with every DHT node answering and
with one node near the claims key stalled (SIGSTOP of its DHT process and p2pd: a laptop that sleeps).

    .venv/bin/python bench/witness_stall.py [--nodes 5] [--trials 3] [--dht-timeout 3.0] [--allreduce-s 1.0]

``--nodes`` real DHT nodes on 127.0.0.1 (``create_dht`` with the run's validators, ``wait_timeout`` =
``--dht-timeout`` as the peer passes ``swarm.dht_timeout``), each joining through node 0. Witnesses run on nodes 1
and 2 (timeout 3 x dht_timeout, as ``swarm.witness_timeout``), both at once in each trial, with new entries (a new
round number) each trial. Two ways, alternated: "after": ``Witness.exchange`` (a store, then a read) once the
simulated all-reduce (``--allreduce-s`` of ``asyncio.sleep``) ends; "overlapped": the same exchange started with the
all-reduce, as a round does once it holds every member's claim (peer/net/round/round_runner.py). Measured: seconds
from the end of the all-reduce to the exchange's answer, whether it read the entries back (not None), and how long
the witnesses' DHT stores and reads took (the longest of each).

Stalled trials: hivemind blacklists a node that did not answer (5 s, doubling); so each such trial stalls afresh:
SIGCONT, the witnesses' nodes' blacklists cleared, one read from each that reaches the stalled node, then SIGSTOP.
The stalled node is, of nodes 3.., the nearest to the key (XOR). Every process is resumed and shut down at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import functools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402

from peer.net.plumbing import dht as dht_node  # noqa: E402
from peer.net.trust.claims import claims_key  # noqa: E402
from peer.net.trust.progress import make_validators  # noqa: E402
from peer.net.witness import Witness  # noqa: E402

RUN = "bench_witness_stall"
WITNESSES = (1, 2)
WAYS = ("after", "overlapped")


async def _node_id(dht, node):  # (run in a DHT process: module level, so that it pickles)
    return node.node_id


async def _forgive(dht, node):
    node.blacklist.clear()


async def _banned(dht, node, peer_id):
    return peer_id in node.blacklist


def p2pd_of(pid: int) -> list[int]:
    """The p2pd children of process ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == "p2pd":
                out.append(int(child))
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Timed:
    """A DHT whose stores and reads the witness makes are timed: ``ops`` gets (store|get, seconds)."""

    def __init__(self, dht):
        self.dht, self.ops = dht, []

    async def store(self, *args, **kwargs):
        return await self._timed("store", self.dht.store(*args, **kwargs))

    async def get(self, *args, **kwargs):
        return await self._timed("get", self.dht.get(*args, **kwargs))

    async def _timed(self, op: str, future):
        t0 = time.monotonic()
        try:
            return await future
        finally:
            self.ops.append((op, time.monotonic() - t0))


class Loop:
    """One event loop that never stops, in a daemon thread (hivemind's MPFutures keep the loop they were made in)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise


async def one_way(w: Witness, entries: list, way: str, allreduce_s: float) -> tuple[float, bool]:
    early = asyncio.ensure_future(w.exchange(entries)) if way == "overlapped" else None
    try:
        await asyncio.sleep(allreduce_s)
        t0 = time.monotonic()
        read = await (w.exchange(entries) if early is None else early)
        return time.monotonic() - t0, read is not None
    finally:
        if early is not None and not early.done():
            early.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3, help="of each way in each condition")
    ap.add_argument("--dht-timeout", type=float, default=3.0)
    ap.add_argument("--allreduce-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.nodes < 4 or args.trials < 1:
        ap.error("--nodes must be >= 4 (node 0, two witnesses, one to stall) and --trials >= 1")
    logging.getLogger("hivemind").setLevel(logging.ERROR)  # (the stalled node's timeouts, in every process)
    timeout = 3 * args.dht_timeout
    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
    print(f"nodes {args.nodes}, dht_timeout {args.dht_timeout:g} s, witness timeout {timeout:g} s, all-reduce "
          f"{args.allreduce_s:g} s, {args.trials} trials per way and condition; witnesses on nodes 1 and 2\n")
    keys = [RSAPrivateKey() for _ in range(args.nodes)]
    made = [make_validators(RUN, key) for key in keys]
    loop, nodes, stopped = Loop(), [], []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i in range(args.nodes):
                initial = dht_node.visible_maddrs(nodes[0]) if nodes else []
                nodes.append(dht_node.create_dht(
                    initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                    identity_path=str(Path(tmp) / f"n{i}.id"), client_mode=False, record_validators=made[i][0],
                    startup_timeout=30, wait_timeout=args.dht_timeout))
            key_id = DHTID.generate(source=claims_key(RUN))
            dist = [key_id.xor_distance(n.run_coroutine(_node_id)) for n in nodes]
            victim = min(range(3, args.nodes), key=lambda i: dist[i])
            rank = sorted(dist).index(dist[victim]) + 1
            stopped = [nodes[victim].pid, *p2pd_of(nodes[victim].pid)]
            print(f"stalled: node {victim} ({rank}. nearest of {args.nodes} to the claims key; pids {stopped})\n")
            witnesses = {i: Witness(Timed(nodes[i]), run_key=RUN, subkey=made[i][1], peer_id=str(nodes[i].peer_id),
                                    horizon=120.0, timeout=timeout) for i in WITNESSES}

            def fresh_stall() -> str:
                signal_all(stopped, signal.SIGCONT)
                for i in WITNESSES:
                    nodes[i].run_coroutine(_forgive)
                    nodes[i].get(claims_key(RUN), latest=True)  # (reaches the resumed node: routes, connection)
                banned = [i for i in WITNESSES
                          if nodes[i].run_coroutine(functools.partial(_banned, peer_id=nodes[victim].peer_id))]
                signal_all(stopped, signal.SIGSTOP)
                return f" (still blacklisted by {banned})" if banned else ""

            results: dict = {}
            round_ = 100
            for condition in ("all answering", "one stalled"):
                for trial in range(args.trials):
                    ways = WAYS if trial % 2 == 0 else WAYS[::-1]
                    for way in ways:
                        round_ += 1
                        note = fresh_stall() if condition == "one stalled" else ""
                        entries = {i: [(1, round_, base64.b64encode(os.urandom(20)).decode(),
                                        str(nodes[i].peer_id), "c2ln")] for i in WITNESSES}

                        async def trial_run():
                            return await asyncio.gather(*(one_way(witnesses[i], entries[i], way, args.allreduce_s)
                                                          for i in WITNESSES))

                        for w in witnesses.values():
                            w.dht.ops.clear()
                        got = loop.run(trial_run(), args.allreduce_s + 2 * timeout + 10)
                        ops = [op for w in witnesses.values() for op in w.dht.ops]
                        results.setdefault((condition, way), []).append((got, note, ops))
                        print(f"  {condition}, {way}, round {round_}: "
                              f"{' / '.join(f'{s:.2f} s {ok}' for s, ok in got)}{note}", file=sys.stderr)
                signal_all(stopped, signal.SIGCONT)
        finally:
            signal_all(stopped, signal.SIGCONT)
            for node in nodes:
                dht_node.shutdown_dht(node)
    print("| condition | way | seconds after the all-reduce, each trial (node 1 / node 2) | max | longest store "
          "/ read (s) | stores | read back ok |")
    print("|---|---|---|---|---|---|---|")
    for (condition, way), rows in results.items():
        secs = "; ".join(" / ".join(f"{s:.2f}" for s, _ in got) + note for got, note, _ in rows)
        worst = max(s for got, _, _ in rows for s, _ in got)
        ops = [op for _, _, trial_ops in rows for op in trial_ops]
        longest = " / ".join(f"{max((s for o, s in ops if o == op), default=0):.2f}" for op in ("store", "get"))
        ok = sum(ok for got, _, _ in rows for _, ok in got)
        print(f"| {condition} | {way} | {secs} | {worst:.2f} | {longest} | {sum(o == 'store' for o, _ in ops)} | "
              f"{ok}/{sum(len(got) for got, _, _ in rows)} |")
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
