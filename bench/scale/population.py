"""Who is there for a round: failures, restarts and state downloads, run on the event core.

Each round slot, every peer that is up (training, or downloading the state after a restart) fails with probability
``p`` at a time drawn uniformly over the slot (a crash: its connections reset at once). Its progress record stays
live until it expires (``progress_ttl`` after its last heartbeat: 25-30 s). It restarts ``restart_s`` later (the
chaos bench's median), publishes its record at once (it counts as live again, so today's matchmaking waits for it)
and downloads the state (``8 bytes x params``) from one random training peer at the slower of that donor's uplink
and its own downlink; then it trains and joins rounds again. So the swarm keeps its size: every failure is a rejoin.
Not modelled: the download's share of the donor's link during rounds, several joiners on one donor.

Whom a round waits for (peer/net/view/attendance.py; design ``flat-attendance``): :attr:`Population.expected` counts the
training peers and the crashed ones whose record is still live, until they missed ``MISSES`` rounds; a peer that
downloads the state is catching up (its record's rounds are behind) and is not waited for. (Probes of an absent
peer come after 1, 3 and 7 more rounds; a crashed peer's record expires before the first at these slot lengths.)
"""

from __future__ import annotations

import numpy as np

from .calibration import Workload
from .events import EventQueue
from .links import Links

TRAINING, DOWN, JOINING = 0, 1, 2
MISSES = 2  # attendance.MISSES


class Population:
    """The peers' states over time. Must be advanced with :meth:`round_start` at increasing slot times."""

    def __init__(self, links: Links, workload: Workload, p_fail: float, rng: np.random.Generator):
        self.links, self.wl, self.p_fail, self.rng = links, workload, p_fail, rng
        n = len(links)
        self.status = np.full(n, TRAINING, np.int8)
        self.record_until = np.full(n, np.inf)  # a DOWN peer's record counts as live until then
        self.death = np.full(n, np.inf)  # this slot's crash time per peer (inf: none)
        self.missed = np.zeros(n, np.int32)  # rounds in a row a crashed peer with a live record was waited for
        self.expected = n  # whom this slot's round waits for (attendance), set by round_start
        self.client = rng.random(n) < workload.client_fraction
        self.queue = EventQueue()
        self.failures = self.rejoins = 0
        self.download_s: list[float] = []

    def _crash(self, peer: int) -> None:
        t = self.queue.now
        self.status[peer] = DOWN
        ttl, period = self.wl.timeouts.progress_ttl, self.wl.timeouts.progress_period
        self.record_until[peer] = t + ttl - period * self.rng.random()
        self.failures += 1
        self.queue.schedule(t + self.wl.costs.restart_s, lambda: self._restart(peer), "restart")

    def _restart(self, peer: int) -> None:
        t = self.queue.now
        if self.status[peer] != DOWN:
            return
        self.status[peer] = JOINING
        self.missed[peer] = 0
        donors = np.flatnonzero(self.status == TRAINING)
        if donors.size == 0:
            seconds = 0.0
        else:
            donor = donors[self.rng.integers(donors.size)]
            rate = self.wl.costs.link_efficiency * min(self.links.up[donor], self.links.down[peer])
            seconds = self.wl.costs.state_bytes_per_param * self.wl.params / rate
        self.download_s.append(seconds)
        self.queue.schedule(t + seconds, lambda: self._joined(peer), "joined")

    def _joined(self, peer: int) -> None:
        if self.status[peer] == JOINING:
            self.status[peer] = TRAINING
            self.rejoins += 1

    def round_start(self, t: float) -> tuple[np.ndarray, int, np.ndarray]:
        """Advances to slot time ``t``; draws this slot's crashes. Returns (training peers, live count as today's
        matchmaking counts it, crash time per peer within this slot or inf)."""
        self.queue.run_until(t)
        training = np.flatnonzero(self.status == TRAINING)
        live = int(np.sum((self.status != DOWN) | (self.record_until > t)))
        ghosts = (self.status == DOWN) & (self.record_until > t)  # crashed, record still live
        waited = ghosts & (self.missed < MISSES)
        self.expected = int(training.size + np.sum(waited))
        self.missed[waited] += 1
        self.death = np.full(len(self.links), np.inf)
        up = np.flatnonzero(self.status != DOWN)
        fails = up[self.rng.random(up.size) < self.p_fail]
        times = t + self.rng.random(fails.size) * self.wl.slot_s
        for peer, when in zip(fails.tolist(), times.tolist()):
            self.death[peer] = when
            self.queue.schedule(when, lambda p=peer: self._crash(p), "crash")
        return training, live, self.death.copy()

    def warm_up(self, seconds: float) -> None:
        """Runs failures and rejoins (no rounds) for ``seconds`` before time 0, so round 0 sees a steady state."""
        self.queue = EventQueue(-seconds)
        t = -seconds
        while t < 0:
            self.round_start(t)
            t += self.wl.slot_s
        self.queue.run_until(0.0)
        self.failures = self.rejoins = 0
        self.download_s.clear()
