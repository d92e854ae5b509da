"""Before a one-level round applies: publish the claims its group's members gave us, and read everyone's
(:mod:`peer.net.trust.claims`).

Each peer stores its recent entries under its own subkey of the run's claims key (signed: only its owner can replace
them), with an expiration that outlasts every other group of their rounds; they are never withdrawn, so a peer that
stops or crashes right after its round leaves them for the group that reads second (a progress record would not: it
is withdrawn at a clean stop and expires ``progress_ttl`` after a crash). What a read shows of any peer in two
groups of one round is judged once per round (:meth:`Witness.judge`): every reader counts it, not only the group
that reads second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from peer.config.fields import MAX_RECORD_TTL
from peer.net.trust.claims import MAX_CLAIMS, Entry, claims_key, equivocations, parse_entries
from peer.net.trust.exclusion import Offence, PeerVerdict
from peer.util import short_id

log = logging.getLogger(__name__)
MAX_JUDGED = 4096  # (peer, fragment, round) judged already, remembered (oldest first out)


class Witness:
    """Publishes this peer's claims entries and reads everyone's. Created by the swarm with its DHT, our record
    subkey (the owner key that signs), ``horizon`` (seconds a group's entries stay published: as long as another group
    of its round can still be reading) and ``timeout`` (a store and a read: up to 2 x dht_timeout and about one while
    a DHT node is unreachable). :meth:`exchange` and :meth:`judge` run on ``swarm-net``, the one writer of what we
    publish and of what we judged."""

    def __init__(self, dht: DHT, *, run_key: str, subkey: bytes, peer_id: str, horizon: float, timeout: float):
        self.dht, self.key, self.subkey, self.peer_id = dht, claims_key(run_key), subkey, peer_id
        self.run_key = run_key
        self.horizon, self.timeout = min(horizon, MAX_RECORD_TTL / 2), timeout
        self._published: list[tuple[float, Entry]] = []  # (monotonic time, entry), newest first
        self._judged: OrderedDict[tuple[str, int, int], None] = OrderedDict()

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

    async def judge(self, read: list[Entry], key_of: Callable[[str], Optional[RSAPublicKey]]) -> list[PeerVerdict]:
        """An offence (``TWO_GROUPS``) for each (peer, fragment, round) that ``read`` shows with valid claims for two
        groups (checked against ``key_of(peer)``: the key of its claim for our group, or of its record) and that we
        did not judge before. The checks run on a worker thread: a key's worth of made-up entries is about half a
        second of them."""
        found = await asyncio.get_running_loop().run_in_executor(None, equivocations, read, self.run_key, key_of)
        verdicts = []
        for (pid, f, r), (one, other) in sorted(found.items()):
            if (pid, f, r) in self._judged:
                continue
            self._judged[(pid, f, r)] = None
            while len(self._judged) > MAX_JUDGED:
                self._judged.popitem(last=False)
            why = f"fragment {f} round {r}: claimed two groups of the round ({one[:8]}, {other[:8]})"
            log.warning("peer %s: peer %s %s", short_id(self.peer_id), short_id(pid), why)
            verdicts.append(PeerVerdict(pid, why, Offence.TWO_GROUPS))
        return verdicts
