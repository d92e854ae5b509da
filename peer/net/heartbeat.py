"""The heartbeat: every ``progress_period`` s this peer's signed progress record goes to the DHT and everyone's
comes back into the :class:`~peer.net.view.roster.Roster`.

:class:`Heartbeat` is the one writer of the roster's records (``Roster.merge``) and of the revocations our DHT
process applies. It runs on the swarm's event loop (``swarm-net``), from :meth:`Heartbeat.run`, which the
:class:`~peer.net.swarm.Swarm` starts and its shutdown cancels.

Invariant: neither a slow store nor a slow read delays the next read or store. While DHT nodes are unreachable
a store waits for each of them in turn (``dht_timeout`` per RPC) and a read for about one; a peer that reads or
publishes less often than ``progress_ttl`` drops the others, or drops out of their view. So stores and reads are
separate tasks, started every period, each bounded by ``progress_ttl``, at most ``MAX_IN_FLIGHT`` of each kind;
a read is merged when it returns (the roster keeps each peer's newest record: order does not matter).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Optional

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from peer.config import SwarmConfig
from peer.net.plumbing.dht import reconnect
from peer.net.plumbing.hivemind_internals import connect
from peer.net.trust.auth import Admission, RunAccess
from peer.net.trust.revocations import revocation_key, revoke_in_dht, revoke_listed
from peer.net.trust.progress import progress_key
from peer.net.trust.records import ProgressRecord
from peer.net.view.roster import Roster
from peer.util import short_id

log = logging.getLogger(__name__)

# Stores and reads in flight at once (each kind): each is bounded by progress_ttl, so this bounds the DHT load of
# a stalled DHT.
MAX_IN_FLIGHT = 4


class Heartbeat:
    """Publishes ``record()`` (called at each store, on ``swarm-net``) under ``subkey`` of the run's progress key
    and merges everyone's records into ``roster``, then calls ``observe()``. ``initial_peers`` ({peer id:
    multiaddrs}) are pinged, with the peers seen before, while we see no one (:meth:`_reconnect`). Its own fields
    (the first read, reconnecting, the revocations our DHT applies) are written by its tasks only, on ``swarm-net``."""

    def __init__(self, cfg: SwarmConfig, *, dht: DHT, p2p: P2P, run_key: str, subkey: bytes, peer_id: str,
                 roster: Roster, admission: Admission, access: Optional[RunAccess],
                 record: Callable[[], ProgressRecord], initial_peers: dict[str, list[str]],
                 observe: Callable[[], None] = lambda: None):
        self.cfg, self.dht, self.p2p, self.peer_id = cfg, dht, p2p, peer_id
        self.key, self.subkey = progress_key(run_key), subkey
        self.roster, self.admission, self.access = roster, admission, access
        self.record, self.initial_peers, self.observe = record, initial_peers, observe
        self._first_read = threading.Event()  # set once the first read of the records ended
        self._greeting = 0  # reads between their merge and the listing after their greetings (wait_settled)
        self._read_ended = threading.Condition()  # notified at the end of each read
        self._reconnecting = False
        self._dht_revoked: frozenset[str] = frozenset()  # revocations our DHT process applies (revoke_in_dht)

    async def run(self) -> None:
        """Starts a store and a read every ``progress_period`` s until cancelled (see the module docstring)."""
        flights: dict[Callable[[], Awaitable[None]], set[asyncio.Task]] = {self._publish: set(), self._read: set()}
        while True:
            for beat, tasks in flights.items():
                if len(tasks) < MAX_IN_FLIGHT:
                    task = asyncio.ensure_future(beat())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            await asyncio.sleep(self.cfg.progress_period)

    def wait_first_read(self, timeout: float) -> bool:
        """Blocks until the first read of the others' progress records ended (found or not), up to ``timeout`` s;
        False on timeout. Until then the roster holds no one."""
        return self._first_read.wait(timeout)

    def wait_settled(self, timeout: float) -> bool:
        """Blocks until every live peer our daemon did not list was greeted, and the daemon's connections listed after
        (whose records anchor a peer that met no one yet: :meth:`Roster.anchored`; :meth:`Roster.ungreeted`), up to
        ``timeout`` s; False on timeout. A read greets at most MAX_ARRIVALS peers, so a crowd of identities takes a
        few reads. (Any thread.)"""
        with self._read_ended:
            return self._read_ended.wait_for(
                lambda: self._greeting == 0 and not self.roster.ungreeted(self.peer_id), timeout)

    async def _publish(self) -> None:
        """Stores our progress record (bounded by ``progress_ttl``; a failed store is logged, nothing else)."""
        t0 = time.monotonic()
        rec = self.record()
        try:
            await asyncio.wait_for(self.dht.store(self.key, rec.model_dump(), get_dht_time() + self.cfg.progress_ttl,
                                                  subkey=self.subkey, return_future=True), self.cfg.progress_ttl)
        except Exception as e:
            log.debug("peer %s: progress store failed: %s", short_id(self.peer_id), type(e).__name__)
        log.debug("peer %s: progress store took %.1f s", short_id(self.peer_id), time.monotonic() - t0)

    async def _read(self) -> None:
        """Reads everyone's progress records and the revocation lists (each bounded by ``progress_ttl``), merges
        the records into the roster, then greets the peers that came into view or, alone, reconnects."""
        t0 = time.monotonic()
        revocations = asyncio.ensure_future(self._read_revocations())
        try:
            found = await asyncio.wait_for(self.dht.get(self.key, latest=True, return_future=True),
                                           self.cfg.progress_ttl)
        except Exception as e:
            log.debug("peer %s: progress get failed: %s", short_id(self.peer_id), type(e).__name__)
            found = None
        accept = None if self.admission.open else self.admission.accept_record
        self._greeting += 1
        try:
            arrived = self.roster.merge(found, dht_now=get_dht_time(), me=self.peer_id, accept=accept)
            self.observe()
            others = [pid for pid in self.roster.live_peers() if pid != self.peer_id]
            if others:
                if arrived:
                    await self._greet(arrived)
                await self._list_connections(now=bool(arrived))
        finally:
            self._greeting -= 1
            with self._read_ended:
                self._read_ended.notify_all()
        self._first_read.set()
        log.debug("peer %s: progress read took %.1f s, %d others live", short_id(self.peer_id),
                  time.monotonic() - t0, len(others))
        if not others:
            await self._reconnect()
        await asyncio.gather(revocations, return_exceptions=True)

    async def _list_connections(self, *, now: bool) -> None:
        """Has the roster's host book list our daemon's connections (whose records anchor a peer that met no one
        yet: :meth:`Roster.vouched_peers`): before the read ends at the first read and after greetings (``now``),
        so that the trainer's first decisions have them (:meth:`wait_settled`), else soon."""
        hosts = self.roster.hosts
        if hosts is None:
            return
        if self._first_read.is_set() and not now:
            hosts.list_soon(self.p2p, self.cfg.request_timeout)
        else:
            await hosts.list_now(self.p2p, self.cfg.request_timeout)

    async def _reconnect(self) -> None:
        """We see no other peer: ping the initial peers and the peers we saw before that our DHT node lost
        (see :func:`peer.net.plumbing.dht.reconnect`). One at a time; bounded by 3 x ``dht_timeout``."""
        peers = {**{pid: [] for pid in self.roster.known()}, **self.initial_peers}
        if self._reconnecting or not peers:
            return
        self._reconnecting = True
        try:
            size = await asyncio.wait_for(reconnect(self.dht, peers, self.cfg.dht_timeout), 3 * self.cfg.dht_timeout)
            log.debug("peer %s: alone, pinged %d known peers: %d in the DHT routing table", short_id(self.peer_id),
                      len(peers), size)
        except Exception as e:
            log.debug("peer %s: reconnect failed: %s", short_id(self.peer_id), type(e).__name__)
        finally:
            self._reconnecting = False

    async def _greet(self, arrived: list[str]) -> None:
        """Opens a libp2p connection to each peer that just came into view (:meth:`Roster.merge`), at the
        addresses our daemon knows, within ``request_timeout``. A peer back from an outage has its own dials
        refused by libp2p's dial backoff for a while; its streams use the connection we open. Nothing else
        (no DHT request, no routing-table change)."""
        async def dial(pid: str) -> None:
            await connect(self.p2p, PeerID.from_base58(pid), [])

        tasks = [asyncio.ensure_future(dial(pid)) for pid in arrived]
        done, pending = await asyncio.wait(tasks, timeout=self.cfg.request_timeout)
        for task in pending:
            task.cancel()
        failed = sum(1 for task in done if task.exception() is not None) + len(pending)
        log.debug("peer %s: greeted %d arriving peers (%d not reached)", short_id(self.peer_id), len(arrived),
                  failed)

    async def _read_revocations(self) -> None:
        """Authenticated runs: reads the authority's revocation lists (published by its bootstrap nodes) and
        stops admitting the peers they name. Bounded by ``progress_ttl``; a failed read changes nothing."""
        if self.access is None:
            return
        found = await asyncio.wait_for(self.dht.get(revocation_key(self.access.checker.authority_bytes), latest=True,
                                                    return_future=True), self.cfg.progress_ttl)
        if found is None or not isinstance(found.value, dict):
            return
        for entry in found.value.values():
            for pid in sorted(revoke_listed(self.admission, getattr(entry, "value", None))):
                log.warning("peer %s: the run authority revoked peer %s's pass: no longer admitted",
                            short_id(self.peer_id), short_id(pid))
        if new := self.admission.revoked - self._dht_revoked:  # our DHT process checks requests with its own checker
            await asyncio.wait_for(self.dht.run_coroutine(partial(revoke_in_dht, new), return_future=True),
                                   self.cfg.progress_ttl)
            self._dht_revoked |= new
