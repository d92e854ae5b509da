"""What both designs share: when each peer is ready to join a group (matchmaking's DHT work), and one round's
outcome per training peer.

A peer launches its round within one step of the slot's start (the clock schedule checks the clock after each
step). hivemind's matchmaking then stores the peer's declaration under the round's key and reads the key's entries
(each a DHT lookup of ``ceil(log2 N)`` hops of one round trip; the calibrated per-round overhead of the LAN runs
covers the local work), and sends a join request to the leader (one round trip). The key's entries live on
``dht_replicas`` nodes: with one key for the whole swarm, each of the N readers gets all N entries, so those nodes
send N^2 entries in all (the hot spot, spread over the replicas' uplinks at the swarm's median rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .calibration import Workload
from .links import Links


@dataclass
class RoundOutcome:
    """Per training peer of one round slot (arrays aligned with ``peers``)."""

    peers: np.ndarray
    launch: np.ndarray
    in_group: np.ndarray  # joined a group that averaged
    matchmaking_s: np.ndarray  # launch to the group's start (nan: none)
    end: np.ndarray  # when the round's outcome is ready to apply (decoded), or given up
    applied: np.ndarray  # fraction of the fragment's elements applied
    sent: np.ndarray  # bytes
    received: np.ndarray
    streams: np.ndarray  # all-reduce streams the peer has open in the round
    remote_peers: np.ndarray  # distinct remote peers it exchanges data with
    died: np.ndarray  # crashed during the round (left out of the means)
    status: str = "ok"  # round-level: ok, no_group, group_error
    levels: int = 1
    flow_steps: int = 0
    extra: dict = field(default_factory=dict)

    def blocked(self, wl: Workload) -> np.ndarray:
        """Seconds each peer's training waits at launch + tau for this round (at most wait_timeout)."""
        return np.clip(self.end - (self.launch + wl.tau_s), 0.0, wl.timeouts.wait_timeout)


def dht_hops(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))))


def launches(peers: np.ndarray, t0: float, wl: Workload, rng: np.random.Generator) -> np.ndarray:
    return t0 + rng.random(peers.size) * wl.step_s


def ready_to_join(peers: np.ndarray, launch: np.ndarray, links: Links, entries: int, n_swarm: int,
                  wl: Workload, rng: np.random.Generator) -> np.ndarray:
    """When each peer's join request can reach a leader: declare + read the key (``entries`` per read) + a round
    trip, plus the hot spot of ``entries`` entries read by every one of the ``entries`` searchers."""
    partners = rng.integers(0, len(links), size=peers.size)
    rtt = links.rtt(peers, partners)
    hops = dht_hops(n_swarm)
    median_up = float(np.median(links.up)) * wl.costs.link_efficiency
    hot_spot = entries * entries * wl.declare_bytes / (wl.dht_replicas * median_up)
    read = entries * wl.declare_bytes / (links.down[peers] * wl.costs.link_efficiency)
    return launch + 2 * hops * rtt + read + rtt + hot_spot * rng.random(peers.size)


def empty_outcome(peers: np.ndarray, launch: np.ndarray, death: np.ndarray, end: np.ndarray, status: str,
                  matchmaking_s: float = np.nan) -> RoundOutcome:
    n = peers.size
    zeros = np.zeros(n)
    return RoundOutcome(peers=peers, launch=launch, in_group=np.zeros(n, bool), matchmaking_s=np.full(n, matchmaking_s),
                        end=end, applied=zeros.copy(), sent=zeros.copy(), received=zeros.copy(),
                        streams=zeros.copy(), remote_peers=zeros.copy(), died=death[peers] < end, status=status)
