"""What libp2p circuit relaying takes with hivemind 1.1.12's p2pd, probed with bare ``hivemind.P2P`` nodes (issue 16).

    sudo .venv/bin/python bench/relay_probe.py [--scenarios works,default-limits,private-relay] [--slow]

Each scenario builds a network lab (``tests/netns.py``) of four hosts: a relay in host 0 (public), a public
caller in host 1, and hosts 2 and 3 behind home routers of their own (iptables masquerade, nothing in but
replies). The *target* in host 2 makes itself dialable through the relay; then the callers in hosts 1 and 3
(host 3 is NAT'd too) call it by peer id only: a 1 MiB unary call and a 3 MiB stream of 48 messages, each echoed.
Printed per scenario: when the target had a ``/p2p-circuit`` address, each call's outcome and the connection it
went over. The options come from ``peer.net.plumbing.dht.relay_options`` (what ``--relay-via`` / ``--relay-service``
do):

- ``works``: the relay with ``relay_service`` (reachability forced public), the target with ``relay_via``
  (static relays, reachability forced private), public-looking lab addresses: all four calls go through.
- ``default-limits``: the relay without ``relay_service``: libp2p's default relay limits apply (128 KiB per
  relayed connection), so a call is reset after 131,072 bytes.
- ``private-relay``: the lab's private addresses (10.77.0.0/24): the target reserves a slot but advertises no
  circuit address (autorelay drops a relay's private addresses): none within 30 s.
- ``discovery`` (only with ``--slow``, about 4 min): hivemind's own ``use_auto_relay=True,
  trusted_relays=[relay]`` (relay discovery on): the first circuit address only after autorelay's 3-minute boot
  delay.

Needs root (network namespaces, iptables); every process and namespace it starts is removed at the end.
See docs/architecture.md, "Peers behind NAT".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from netns import PUBLIC_SUBNET, SUBNET, NetnsLab, nat_available  # noqa: E402

UNARY_BYTES, STREAM_BYTES, STREAM_MESSAGES = 1 << 20, 3 << 20, 48
SCENARIOS = {  # name: (relay side, target side, lab subnet, seconds to wait for the target's circuit address)
    "works": ("relay_service", "relay_via", PUBLIC_SUBNET, 60),
    "default-limits": ("plain", "relay_via", PUBLIC_SUBNET, 60),
    "private-relay": ("relay_service", "relay_via", SUBNET, 30),
    "discovery": ("relay_service", "hivemind", PUBLIC_SUBNET, 300),
}


def _out(**event) -> None:
    print(json.dumps(event), flush=True)


async def node(spec: dict) -> None:
    """One node: starts a P2P daemon as ``spec`` says, serves ``echo`` (unary) and ``stream``; a caller calls the
    target; prints JSON lines; runs until stdin closes."""
    from hivemind.p2p import P2P, P2PContext, PeerID
    from hivemind.proto import runtime_pb2

    from peer.net.plumbing.dht import _register_relay_modes, relay_options

    kwargs: dict = dict(host_maddrs=[spec["host"]], initial_peers=spec.get("initial") or None, nat_port_map=False,
                        check_if_identity_free=False)
    side = spec.get("side", "plain")
    if side == "relay_service":
        kwargs.update(relay_options([], relay_service=True, client_mode=False))
    elif side == "relay_via":
        kwargs.update(relay_options(spec["initial"], relay_service=False, client_mode=False))
    elif side == "hivemind":  # hivemind's own options: relay discovery stays on
        kwargs.update(use_auto_relay=True, trusted_relays=spec["initial"])
    _register_relay_modes(kwargs)
    p2p = await P2P.create(**kwargs)
    _out(event="up", id=str(p2p.peer_id), maddrs=[str(m) for m in await p2p.get_visible_maddrs()])

    async def echo(request: runtime_pb2.Tensor, _: P2PContext) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(size=[len(request.buffer)])

    async def stream(requests, _: P2PContext):
        async for request in requests:
            yield runtime_pb2.Tensor(buffer=request.buffer)

    await p2p.add_protobuf_handler("echo", echo, runtime_pb2.Tensor)
    await p2p.add_protobuf_handler("stream", stream, runtime_pb2.Tensor, stream_input=True, stream_output=True)

    async def watch() -> None:
        seen: list[str] = []
        while True:
            maddrs = sorted(str(m) for m in await p2p.get_visible_maddrs(latest=True))
            if maddrs != seen:
                _out(event="maddrs", maddrs=maddrs)
                seen = maddrs
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    if spec.get("call"):
        target = PeerID.from_base58(spec["call"])
        t0 = time.monotonic()
        try:
            reply = await asyncio.wait_for(p2p.call_protobuf_handler(
                target, "echo", runtime_pb2.Tensor(buffer=os.urandom(UNARY_BYTES)), runtime_pb2.Tensor), 60)
            _out(event="unary", ok=list(reply.size) == [UNARY_BYTES], seconds=round(time.monotonic() - t0, 2))
        except Exception as e:
            _out(event="unary", ok=False, error=f"{type(e).__name__}: {e}"[:300])
        t0 = time.monotonic()
        try:
            chunk = os.urandom(STREAM_BYTES // STREAM_MESSAGES)

            async def parts():
                for _ in range(STREAM_MESSAGES):
                    yield runtime_pb2.Tensor(buffer=chunk)

            got = 0
            async for reply in await p2p.iterate_protobuf_handler(target, "stream", parts(), runtime_pb2.Tensor):
                got += len(reply.buffer)
            _out(event="stream", ok=got == STREAM_BYTES, seconds=round(time.monotonic() - t0, 2))
        except Exception as e:
            _out(event="stream", ok=False, error=f"{type(e).__name__}: {e}"[:300])
        conns = [str(a) for info in await p2p.list_peers() if info.peer_id == target for a in info.addrs]
        _out(event="connection", addrs=conns)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the probe closes our stdin
    watcher.cancel()
    await p2p.shutdown()


class Node:
    """A node process in a lab host; its JSON lines in a queue."""

    def __init__(self, lab: NetnsLab, host: int, spec: dict):
        spec = dict(spec, host=f"/ip4/{lab.addr(host)}/tcp/0")
        self.proc = subprocess.Popen(lab.run_args(host, [sys.executable, __file__, "--node", json.dumps(spec)]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=REPO, start_new_session=True)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def wait(self, kind: str, timeout: float, pred=lambda e: True) -> dict | None:
        """The next event of ``kind`` that ``pred`` accepts, or None after ``timeout`` s (or if the node died)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if event is None:
                return None
            if event["event"] == kind and pred(event):
                return event
        return None

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_scenario(name: str) -> list[str]:
    relay_side, target_side, subnet, circuit_wait = SCENARIOS[name]
    lines = []
    nodes: list[Node] = []
    with NetnsLab(4, nat=[2, 3], subnet=subnet) as lab:
        try:
            relay = Node(lab, 0, dict(side=relay_side))
            nodes.append(relay)
            up = relay.wait("up", 60)
            assert up, "the relay did not start"
            relay_maddr = next(m for m in up["maddrs"] if f"/{lab.addr(0)}/" in m)
            target = Node(lab, 2, dict(side=target_side, initial=[relay_maddr]))
            nodes.append(target)
            up = target.wait("up", 60)
            assert up, "the target did not start"
            t0 = time.monotonic()
            circuit = target.wait("maddrs", circuit_wait, lambda e: any("/p2p-circuit" in m for m in e["maddrs"]))
            if circuit is None:
                lines.append(f"{name}: no /p2p-circuit address within {circuit_wait} s")
                return lines
            lines.append(f"{name}: circuit address after {time.monotonic() - t0:.1f} s")
            for host in (1, 3):
                caller = Node(lab, host, dict(initial=[relay_maddr], call=up["id"]))
                nodes.append(caller)
                where = "public" if host == 1 else "NAT'd"
                for kind in ("unary", "stream"):
                    got = caller.wait(kind, 120)
                    outcome = "no answer" if got is None else (f"ok in {got['seconds']} s" if got["ok"]
                                                               else f"FAILED: {got.get('error', 'wrong reply')}")
                    size = UNARY_BYTES if kind == "unary" else STREAM_BYTES
                    lines.append(f"  {where} caller, {kind} ({size >> 20} MiB): {outcome}")
                conn = caller.wait("connection", 30)
                lines.append(f"  {where} caller's connection to the target: {conn['addrs'] if conn else '?'}")
        finally:
            for n in nodes:
                n.stop()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="works,default-limits,private-relay",
                    help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--slow", action="store_true", help="also run 'discovery' (about 4 minutes)")
    ap.add_argument("--node", default="", help=argparse.SUPPRESS)  # internal: one node of a scenario
    args = ap.parse_args()
    if args.node:
        asyncio.run(node(json.loads(args.node)))
        return 0
    ok, why = nat_available()
    if not ok:
        print(f"bench/relay_probe.py: {why}", file=sys.stderr)
        return 2
    names = [s for s in args.scenarios.split(",") if s] + (["discovery"] if args.slow else [])
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        print(f"bench/relay_probe.py: unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    for name in dict.fromkeys(names):
        for line in run_scenario(name):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
