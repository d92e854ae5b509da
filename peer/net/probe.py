"""A look at a run's swarm from outside it (``swarm-peer doctor``): a throw-away DHT client joins through the
initial peers, pings each (their DHT time against ours: the clock skew) and reads the run's progress records
(who trains it). It publishes nothing and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Optional

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from peer.config import PeerConfig
from peer.net.trust.auth import PassChecker, record_admitted
from peer.net.plumbing.dht import create_dht, shutdown_dht
from peer.net.plumbing.dial_back import ask_initial_peers
from peer.net.trust.progress import make_validators, progress_key
from peer.net.trust.records import ProgressRecord, live_at
from peer.net.swarm import swarm_key
from peer.proto import reachability_pb2


@dataclasses.dataclass
class Probe:
    clocks: list[tuple[str, float, float]]  # (peer id, its clock minus ours in s, round-trip time in s)
    live_peers: int  # peers with a record of this run written within progress_ttl
    steps: list[int]  # their steps (sorted)


async def _ping_all(_dht, node: DHTNode, peers: list[str], timeout: float) -> list[tuple[str, float, float]]:
    """Runs in the DHT process: one ping per peer; skew = their time at the midpoint of the round trip."""
    out = []
    for text in peers:
        peer_id = PeerID.from_base58(text)
        t0 = get_dht_time()
        try:
            response = await node.protocol.get_stub(peer_id).rpc_ping(
                dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False), timeout=timeout)
        except Exception:
            continue
        t1 = get_dht_time()
        if response.dht_time:
            out.append((text, response.dht_time - (t0 + t1) / 2, t1 - t0))
    return out


def probe_swarm(cfg: PeerConfig, *, timeout: float) -> Probe:
    """Joins as a client for a moment. Raises what :func:`~peer.net.plumbing.dht.create_dht` raises when no initial peer
    answers."""
    sw = cfg.swarm
    run_key = swarm_key(sw.run_id, cfg.run_hash(), cfg.outer.codec)
    # the records are signed: the signature validator strips the signatures (and the schema validator checks them)
    validators, _ = make_validators(run_key)
    dht = create_dht(initial_peers=sw.initial_peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], announce_maddrs=[],
                     identity_path=None, client_mode=True, startup_timeout=sw.startup_timeout,
                     wait_timeout=min(timeout, sw.dht_timeout), record_validators=validators)
    try:
        peers = sorted({str(Multiaddr(m).value_for_protocol("p2p")) for m in sw.initial_peers})
        ping = functools.partial(_ping_all, peers=peers, timeout=timeout)  # (pickled to the DHT process)
        clocks = dht.run_coroutine(ping, return_future=True).result(timeout * (len(peers) + 1))
        now = get_dht_time()
        steps = [rec.step for rec in read_records(dht, run_key, timeout=2 * timeout)
                 if live_at(rec, now, sw.progress_ttl) and not rec.paused]
        return Probe(clocks=clocks, live_peers=len(steps), steps=sorted(steps))
    finally:
        shutdown_dht(dht)


def ask_to_be_dialed(cfg: PeerConfig, *,
                     timeout: float) -> tuple[Optional[reachability_pb2.DialBackReply], list[str]]:
    """Listens where the peer would (``swarm.host_maddrs``, announcing ``swarm.announce_maddrs``) and asks the
    initial peers to dial it back: :func:`peer.net.plumbing.dial_back.ask_initial_peers`; returns the reply and the
    addresses it asked to be dialed at. Raises what the daemon raises when it cannot listen there."""
    sw = cfg.swarm

    async def run() -> tuple[Optional[reachability_pb2.DialBackReply], list[str]]:
        p2p = await P2P.create(host_maddrs=sw.host_maddrs, announce_maddrs=sw.announce_maddrs or None,
                               nat_port_map=False)
        try:
            mine = [str(m).split("/p2p/")[0] for m in (sw.announce_maddrs or await p2p.get_visible_maddrs())]
            return await ask_initial_peers(p2p, sw.initial_peers, mine, timeout), mine
        finally:
            await p2p.shutdown()

    return asyncio.run(run())


def read_records(dht, run_key: str, *, timeout: float, checker: Optional[PassChecker] = None) -> list[ProgressRecord]:
    """The run's progress records in the DHT (signed: ``dht`` must have been created with
    :func:`~peer.net.trust.progress.make_validators`' validators), each checked (``ProgressRecord.from_wire``); in an
    authenticated run (``checker``) only those that carry a valid pass of their signer. Raises TimeoutError when
    the DHT does not answer within ``timeout`` s."""
    found = dht.get(progress_key(run_key), latest=True, return_future=True).result(timeout)
    value = found.value if found is not None and isinstance(found.value, dict) else {}
    records = []
    for subkey, entry in value.items():
        try:
            rec = ProgressRecord.from_wire(entry.value)
        except (ValueError, TypeError):
            continue
        if checker is None or record_admitted(checker, subkey, rec.pass_line, rec.peer_id):
            records.append(rec)
    return records
