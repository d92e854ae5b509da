"""Does our relay serve with the limits we configured? (``swarm-bootstrap --relay-service``)

hivemind's p2pd registers libp2p's relay service with its default limits (128 KiB per relayed connection) and
its configured one (30 min, 4 GiB) for the same protocol; whichever registers last serves every circuit, and now
and then the default one does (docs/architecture.md, "Peers behind NAT"). Such a relay resets every relayed
stream after 128 KiB: peers behind a NAT lose every span they exchange through it. :func:`relay_serves` asks at
start: two throwaway daemons on this host, one holding a reservation at the relay, the other sending it
``PROBE_BYTES`` through the circuit. The bootstrap node starts its DHT again while the answer is no.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

log = logging.getLogger(__name__)

PROBE_BYTES = 512 * 1024  # four times what the default limits let through
_LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def relay_serves(relay: str, timeout: float) -> Optional[bool]:
    """Whether ``relay`` (a multiaddr with its ``/p2p/`` id) carries ``PROBE_BYTES`` through a circuit: True,
    False (the stream was reset: default limits), or None (no answer within ``timeout`` s: could not tell)."""
    try:
        return asyncio.run(asyncio.wait_for(_probe(relay, time.monotonic() + timeout), timeout + 30))
    except (asyncio.TimeoutError, OSError, RuntimeError) as e:
        log.debug("relay check: %s: %s", type(e).__name__, e)
        return None


async def _connected(create, deadline: float):
    """``await create()`` (a P2P daemon whose bootstrap peers must answer), again every 0.5 s while p2pd says it
    failed to connect, until ``deadline``; None then (a node just started may not answer yet)."""
    while True:
        try:
            return await create()
        except Exception as e:  # p2pd: "failed to connect to bootstrap peers"
            if time.monotonic() >= deadline:
                log.debug("relay check: %s", e)
                return None
            await asyncio.sleep(0.5)


async def _probe(relay: str, deadline: float) -> Optional[bool]:
    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto import runtime_pb2

    from peer.net.plumbing.dht import _register_relay_modes, relay_options

    opts = relay_options([relay], relay_service=False, client_mode=False)
    _register_relay_modes(opts)
    common = dict(nat_port_map=False, check_if_identity_free=False)
    # the target listens nowhere: the caller can reach it through the circuit only
    target = await _connected(lambda: P2P.create(initial_peers=[relay], no_listen=True, **common, **opts), deadline)
    if target is None:
        log.debug("relay check: could not connect to %s", relay)
        return None
    caller = None
    try:
        async def echo(request: runtime_pb2.Tensor, _: P2PContext) -> runtime_pb2.Tensor:
            return runtime_pb2.Tensor(size=[len(request.buffer)])

        await target.add_protobuf_handler("relay_check", echo, runtime_pb2.Tensor)
        circuit = f"{relay}/p2p-circuit/p2p/{target.peer_id}"
        # (until the target's reservation is made, the circuit cannot be dialed)
        caller = await _connected(lambda: P2P.create(initial_peers=[circuit], host_maddrs=_LOCAL, **common), deadline)
        if caller is None:
            log.debug("relay check: no circuit to %s", circuit)
            return None
        try:
            reply = await asyncio.wait_for(caller.call_protobuf_handler(
                target.peer_id, "relay_check", runtime_pb2.Tensor(buffer=os.urandom(PROBE_BYTES)),
                runtime_pb2.Tensor), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        except Exception as e:  # a reset stream (P2PDaemonError, ConnectionResetError)
            log.debug("relay check: %s: %s", type(e).__name__, e)
            return False
        return list(reply.size) == [PROBE_BYTES]
    finally:
        for node in (caller, target):
            if node is not None:
                await node.shutdown()
