"""Before a one-level round applies: publish the claims its group's members gave us, and read everyone's
(:mod:`peer.net.trust.claims`).

Each peer stores its recent entries under its own subkey of the run's claims key (signed: only its owner can replace
them), with an expiration that outlasts every other group of their rounds; they are never withdrawn, so a peer that
stops or crashes right after its round leaves them for the group that reads second (a progress record would not: it
is withdrawn at a clean stop and expires ``progress_ttl`` after a crash).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from peer.config.fields import MAX_RECORD_TTL
from peer.net.trust.claims import MAX_CLAIMS, Entry, claims_key, parse_entries
from peer.util import short_id

log = logging.getLogger(__name__)


class Witness:
    """Publishes this peer's claims entries and reads everyone's. Created by the swarm with its DHT, our record
    subkey (the owner key that signs), ``horizon`` (seconds a group's entries stay published: as long as another group
    of its round can still be reading) and ``timeout`` (a store and a read: up to 2 x dht_timeout and about one while
    a DHT node is unreachable). :meth:`exchange` runs on ``swarm-net``, the one writer of what we publish."""

    def __init__(self, dht: DHT, *, run_key: str, subkey: bytes, peer_id: str, horizon: float, timeout: float):
        self.dht, self.key, self.subkey, self.peer_id = dht, claims_key(run_key), subkey, peer_id
        self.horizon, self.timeout = min(horizon, MAX_RECORD_TTL / 2), timeout
        self._published: list[tuple[float, Entry]] = []  # (monotonic time, entry), newest first

    async def exchange(self, entries: list[Entry]) -> Optional[list[Entry]]:
        """Adds ``entries`` (:func:`~peer.net.trust.claims.claim_entries` of a group of ours) to what we publish
        (with the others of the last ``horizon`` s, newest first, at most MAX_CLAIMS), stores it, then reads
        everyone's: every entry published (None: not done within ``timeout``, or ours read back without
        ``entries``). What a read finds was stored after our store ended or is read with it: the order the claims
        rely on. A store's own answer says little (a node keeps the newest of our values, maybe another round's)."""
        now = time.monotonic()
        kept = [(t, e) for t, e in self._published if t + self.horizon >= now]
        self._published = [*((now, e) for e in entries), *kept][:MAX_CLAIMS]
        value = [list(e) for _, e in self._published]

        async def store_then_read():
            await self.dht.store(self.key, value, get_dht_time() + self.horizon, subkey=self.subkey,
                                 return_future=True)
            return await self.dht.get(self.key, latest=True, return_future=True)

        try:
            found = await asyncio.wait_for(store_then_read(), self.timeout)
        except Exception as e:
            log.info("peer %s: publishing and reading the claims failed: %s", short_id(self.peer_id),
                     type(e).__name__)
            return None
        if found is None or not isinstance(found.value, dict):
            return None
        read, ours = [], None
        for subkey, item in found.value.items():
            published = parse_entries(item.value)
            read.extend(published)
            if subkey == self.subkey:
                ours = set(published)
        if ours is None or not set(entries) <= ours:
            log.info("peer %s: our claims were not read back", short_id(self.peer_id))
            return None
        return read
