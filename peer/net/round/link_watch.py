"""Whether our daemon still holds a connection to each member of one all-reduce (a data structure with the task that
lists the daemon's connections; :func:`peer.net.round.allreduce.run_allreduce` owns one per round).

A member killed mid-round (kill -9) leaves the libp2p streams our handlers read open: the daemon drops the
connection within seconds but does not end those streams, so a reducer waited ``part_timeout`` for a
dead member's part and a member waited the round's whole deadline for a dead reducer's average (30 s where the
connection was gone after 2). Invariant: a member counts as *lost* only once the daemon listed a connection to it
during the round and then, ``misses`` listings in a row, did not; a failed listing counts as nothing. Losing a
member ends only our waits for what it would send, as its deadline would have: every span still has one reducer
whose one result every member decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Iterable

from hivemind.p2p import P2P

log = logging.getLogger(__name__)

LISTING_PERIOD_S = 1.0  # seconds between two listings of the daemon's connections during a round
MISSES = 2  # listings in a row without a connection that make a member lost (a reconnect in between forgives)


class LinkWatch:
    """The members ``peers`` (ids; ours left out by the caller) of one round, as our daemon's listings show them.
    ``lost(peer)`` is an event set once the peer is lost; ``on_lost`` callbacks run then, once per peer. Used from
    the event loop that owns ``p2p``; :meth:`start` and :meth:`stop` belong to the round that made it."""

    def __init__(self, p2p: P2P, peers: Iterable[str], *, period: float = LISTING_PERIOD_S, misses: int = MISSES,
                 timeout: float = 5.0):
        self.p2p, self.period, self.misses, self.timeout = p2p, period, misses, timeout
        self._events = {peer: asyncio.Event() for peer in peers}
        self._seen: set[str] = set()  # listed as connected at least once during the round
        self._missed = {peer: 0 for peer in self._events}
        self._callbacks: list[Callable[[str], None]] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    def lost(self, peer: str) -> asyncio.Event:
        return self._events.get(peer) or asyncio.Event()  # (a peer not watched is never lost)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)

    def start(self) -> None:
        if self._events and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Ends the listings; returns within a listing period. (The flag, not only the cancellation: Python 3.11's
        ``asyncio.wait_for`` drops a cancellation that arrives as its inner call completes.)"""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while not self._stopping and any(not event.is_set() for event in self._events.values()):
            try:
                async with asyncio.timeout(self.timeout):
                    infos = await self.p2p.list_peers()
            except Exception as e:  # (a slow daemon: nobody is judged on a listing we do not have)
                log.debug("could not list the daemon's connections: %s: %s", type(e).__name__, e)
            else:
                if not self._stopping:
                    self.learn({str(info.peer_id) for info in infos})
            await asyncio.sleep(self.period)

    def learn(self, connected: set[str]) -> None:
        """One listing of the daemon's connections (peer ids)."""
        for peer, event in self._events.items():
            if event.is_set():
                continue
            if peer in connected:
                self._seen.add(peer)
                self._missed[peer] = 0
            elif peer in self._seen:
                self._missed[peer] += 1
                if self._missed[peer] >= self.misses:
                    event.set()
                    for callback in self._callbacks:
                        callback(peer)
