"""Dial-back: whether others can dial this machine, asked of a node of the swarm (``swarm-peer doctor``).

A peer that others cannot dial (behind a NAT without a forwarded port) cannot reduce a span or serve state: it
should run in client mode. Only someone outside can tell, so, as Petals does, the doctor asks a node it can reach
(a bootstrap node or a peer: both serve ``rpc_dial_back``) to open a *fresh* connection to it, from a throw-away
libp2p daemon so that the connection the request came on does not count.

The handler is a public service of every node, so it is bounded: one dial-back at a time and ``per_minute`` in
all (others are told "busy"), the requester's own peer id only (libp2p checks it in the handshake), at most four
TCP addresses, and only those at an IP the request itself came from: nobody can make a node dial a third party.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import deque
from typing import AsyncIterator, Optional, Sequence

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.utils.multiaddr import Multiaddr

from peer.net.plumbing.hivemind_internals import connect
from peer.net.flow.streams import StreamGuard, drain, single_request
from peer.net.plumbing.reachability import dial_failure
from peer.proto import reachability_pb2 as pb

log = logging.getLogger(__name__)
MAX_ADDRESSES, MAX_ADDRESS_CHARS = 4, 256
ASKS_PER_NODE = 2  # requests to one node whose exchange failed (not a reply: a busy node's is one) before the next
ASK_AGAIN_AFTER = 1.0  # seconds before asking a node again


def tcp_ip(maddr: str) -> Optional[str]:
    """The IP of a ``/ip4|ip6/IP/tcp/PORT[/...]`` address, or None for any other (or malformed) one."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError:
        return None


def dialable(requested: Sequence[str], observed_ips: set[str]) -> list[str]:
    """The requested addresses a node may dial back: TCP ones at an IP the request came from, without a
    ``/p2p/`` part (the requester's id is the one dialed), at most MAX_ADDRESSES."""
    out = []
    for text in requested[:MAX_ADDRESSES]:
        if len(text) <= MAX_ADDRESS_CHARS and "/p2p/" not in text and tcp_ip(text) in observed_ips:
            out.append(text)
    return out


class DialBackServicer(ServicerBase):
    """Serves ``rpc_dial_back``. Must be added to a P2P instance with :meth:`add_p2p_handlers` (its own)."""

    def __init__(self, *, guard: StreamGuard, timeout: float, request_timeout: float, per_minute: int = 6):
        self.guard, self.timeout, self.request_timeout, self.per_minute = guard, timeout, request_timeout, per_minute
        self._busy = asyncio.Lock()
        self._recent: deque[float] = deque()  # when the last dial-backs started
        self._p2p: Optional[P2P] = None

    async def add_p2p_handlers(self, p2p: P2P, *args, **kwargs) -> None:
        self._p2p = p2p
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def rpc_dial_back(self, requests: AsyncIterator[pb.DialBackRequest],
                            context: P2PContext) -> AsyncIterator[pb.DialBackReply]:
        # (a dial-back tries up to MAX_ADDRESSES addresses after starting a daemon: seconds)
        with self.guard.admit(str(context.remote_id), MAX_ADDRESSES * self.timeout + 30) as refusal:
            if refusal:
                await drain(requests)  # (closing before its request is read resets the stream: no answer arrives)
                yield pb.DialBackReply(error=refusal)
                return
            try:
                request = await single_request(requests, self.request_timeout)
            except (asyncio.TimeoutError, StopAsyncIteration, ValueError) as e:
                yield pb.DialBackReply(error=f"no single request within {self.request_timeout:g} s "
                                             f"({type(e).__name__})")
                return
            yield await self._dial_back(context.remote_id, list(request.maddrs))

    async def _dial_back(self, requester: PeerID, requested: list[str]) -> pb.DialBackReply:
        assert self._p2p is not None, "Must be added to a P2P instance first"
        observed = {ip for info in await self._p2p.list_peers() if info.peer_id == requester
                    for ip in (tcp_ip(str(m)) for m in info.addrs) if ip}
        seen_at = min(observed) if len(observed) == 1 else ""  # (several connections: cannot tell which)
        targets = dialable(requested, observed)
        if not targets:  # (costs no dial: not counted below)
            return pb.DialBackReply(error=f"none of the addresses is a TCP address at the IP this request came "
                                          f"from ({', '.join(sorted(observed)) or 'unknown'})", observed_ip=seen_at)
        now = time.monotonic()
        while self._recent and now - self._recent[0] > 60:
            self._recent.popleft()
        if self._busy.locked() or len(self._recent) >= self.per_minute:
            return pb.DialBackReply(error="busy: try again in a minute", observed_ip=seen_at)
        async with self._busy:
            self._recent.append(now)
            reply = await dial_fresh(requester, targets, self.timeout)
            reply.observed_ip = seen_at
            return reply


async def dial_fresh(peer_id: PeerID, maddrs: Sequence[str], timeout: float) -> pb.DialBackReply:
    """Opens a new connection to ``peer_id`` at each of ``maddrs`` in turn from a throw-away daemon (a connection
    that already exists proves nothing); the first that succeeds answers."""
    probe = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"], nat_port_map=False)
    errors = []
    try:
        for text in maddrs:
            try:
                await asyncio.wait_for(connect(probe, peer_id, [Multiaddr(text)]), timeout)
                return pb.DialBackReply(reachable=True, address=text, dialed=True)
            except asyncio.TimeoutError:
                errors.append(f"{text}: no answer within {timeout:g} s")
            except Exception as e:
                errors.append(f"{text}: {dial_failure(str(e))}")
        return pb.DialBackReply(error="; ".join(errors)[:1000], dialed=True)
    finally:
        await probe.shutdown()


async def ask_dial_back(p2p: P2P, node: PeerID, maddrs: Sequence[str], timeout: float) -> pb.DialBackReply:
    """Asks ``node`` (connected or dialable from ``p2p``) to dial us back at ``maddrs``."""
    stub = DialBackServicer.get_stub(p2p, node)
    stream = await asyncio.wait_for(stub.rpc_dial_back(pb.DialBackRequest(maddrs=list(maddrs))), timeout)
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    finally:
        await stream.aclose()


async def ask_initial_peers(p2p: P2P, initial_peers: Sequence[str], maddrs: Sequence[str],
                             timeout: float) -> Optional[pb.DialBackReply]:
    """Asks the initial peers, one after another, to dial ``p2p`` back at ``maddrs``: the first reply of a node
    that dialed, else the last reply of one that would not (busy, refused: an authenticated run's peers serve
    only peers with a pass; no address at our IP), else None (no node serves dial-back or none answered)."""
    last: Optional[pb.DialBackReply] = None
    for text in initial_peers:
        maddr = Multiaddr(text)
        node = PeerID.from_base58(maddr.value_for_protocol("p2p"))
        reply = None
        for attempt in range(ASKS_PER_NODE):
            try:
                await asyncio.wait_for(connect(p2p, node, [maddr.decapsulate(f"/p2p/{node}")]), timeout)
                reply = await ask_dial_back(p2p, node, maddrs, timeout=MAX_ADDRESSES * timeout + 30)
                break
            except Exception as e:  # (a node without the service, gone, or a connection that closed under us)
                log.debug("dial-back from %s (attempt %d of %d): %s: %s", text, attempt + 1, ASKS_PER_NODE,
                          type(e).__name__, e)
                # (a stream that ends with no reply is a connection that failed under the request, not an
                # answer, even from a node whose service is up: that node is asked once more before the next)
                if attempt + 1 < ASKS_PER_NODE:
                    await asyncio.sleep(ASK_AGAIN_AFTER)
        if reply is None:  # the next node
            continue
        if reply.dialed:
            return reply
        last = reply
    return last


def not_dialable(reply: Optional[pb.DialBackReply], own_maddrs: Sequence[str]) -> Optional[str]:
    """Why nobody outside can dial a peer listening at ``own_maddrs``, judged from a dial-back ``reply``; None
    when the reply does not show it (reachable, or the node did not dial and saw us at one of our own IPs)."""
    if reply is None:
        return None
    if reply.dialed and not reply.reachable:
        return f"a fresh connection to it failed ({reply.error})"
    own_ips = {tcp_ip(m) for m in own_maddrs} - {None}
    if not reply.dialed and reply.observed_ip and reply.observed_ip not in own_ips:
        return (f"the swarm sees it at {reply.observed_ip}, which is none of its own addresses "
                f"({', '.join(sorted(str(ip) for ip in own_ips)) or 'none'}): it is behind a NAT")
    return None


async def nat_verdict(p2p: P2P, initial_peers: Sequence[str], timeout: float) -> Optional[str]:
    """Why nobody outside can dial ``p2p`` (:func:`not_dialable`), asking the initial peers; None when it can be
    dialed, when nobody could tell, or when it listens on loopback only (a swarm on one machine: nothing to ask)."""
    mine = [str(m).split("/p2p/")[0] for m in await p2p.get_visible_maddrs()]
    ips = [tcp_ip(m) for m in mine]
    if all(ip is None or ipaddress.ip_address(ip).is_loopback for ip in ips):
        return None
    return not_dialable(await ask_initial_peers(p2p, initial_peers, mine, timeout), mine)


class DialBackService:
    """``rpc_dial_back`` on a node that has no event loop of its own (``swarm-bootstrap``): a thread running one,
    a replica of the DHT's P2P, the servicer. :meth:`start` after the DHT is up, :meth:`stop` before it goes."""

    def __init__(self, *, timeout: float = 5.0, request_timeout: float = 5.0):
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dial-back", daemon=True)
        self.servicer = DialBackServicer(guard=StreamGuard(per_peer=2, total=32), timeout=timeout,
                                         request_timeout=request_timeout)
        self._p2p: Optional[P2P] = None

    def start(self, dht, timeout: float = 30.0) -> None:
        self._thread.start()
        self._p2p = asyncio.run_coroutine_threadsafe(dht.replicate_p2p(), self._loop).result(timeout)
        asyncio.run_coroutine_threadsafe(self.servicer.add_p2p_handlers(self._p2p), self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Idempotent."""
        if self._thread.is_alive():
            if self._p2p is not None:
                try:
                    asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), self._loop).result(timeout)
                except Exception as e:  # (the DHT may have taken the daemon down first)
                    log.debug("dial-back: P2P replica shutdown: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
