"""How long a group we lead waits for each peer once most of the peers it expects are in (pure: no I/O).

Waiting for a straggler keeps the swarm in one group, and costs every member that waits. A peer that is late at
every round (stuck in another group of its own making, or on a link too slow for the swarm) would cost each round
up to ``matchmaking_time``. So each peer has an *allowance*: seconds a group we lead may wait for it past the
moment more than half of the peers the round expects joined (the quorum). Every round we lead spends what it waited
for a peer there and adds ``per_round`` back, up to ``cap``: a peer that is seldom late has the whole
``matchmaking_time``, one that is late at every round costs at most ``per_round`` a round. Peers never in a group
with us share one allowance (fresh ids cost nothing), as in :mod:`peer.net.view.attendance`.

Only a leader sees when each member joined; each honest leader learns for itself (a follower's word on who was
late could frame an honest peer).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

from peer.net.view.attendance import MAX_TRACKED, STRANGERS, judged_as


def waits(wanted: frozenset[str], joined: Mapping[str, float], now: float, quorum: int,
          allowance: Callable[[str], float], me: str) -> tuple[frozenset[str], Optional[dict[str, float]]]:
    """What a leader still waits for at ``now``, and for how long it waited for each peer it expects.

    ``wanted``: the peers whose arrival assembles the group (:func:`~peer.net.view.attendance.early_assembly`,
    us (``me``) included); ``joined``: when each peer in the group so far joined (us: when our search began),
    in the clock of ``now``; ``quorum``: more than half of ``wanted`` (the group's minimum size). Once
    ``quorum`` of ``wanted`` are in (the *anchor*: when the last of them joined), a peer of ``wanted`` not in
    yet is waited for until ``allowance(peer)`` s past the anchor, then dropped from the set returned. The
    waits: {peer of ``wanted`` but us: seconds past the anchor it joined at, or, not in, waited so far (at most
    its allowance)}; None before the anchor (nobody kept the group waiting yet)."""
    arrived = sorted(t for peer, t in joined.items() if peer in wanted)
    if quorum < 1 or len(arrived) < quorum:
        return wanted, None
    anchor = arrived[quorum - 1]
    waited, still = {}, set()
    for peer in wanted:
        if peer in joined:
            waited[peer] = max(0.0, joined[peer] - anchor)
            still.add(peer)
            continue
        allowed = max(0.0, allowance(peer))
        waited[peer] = min(now - anchor, allowed)
        if now - anchor < allowed:
            still.add(peer)
    waited.pop(me, None)
    return frozenset(still), waited


class Punctuality:
    """Each peer's allowance (see the module). One writer, the swarm on its event loop
    (:class:`~peer.net.swarm.Swarm`): :meth:`settle` when a round we led hands back its waits; :meth:`allowance`
    only reads."""

    def __init__(self, *, per_round: float, cap: float):
        if per_round < 0 or cap < 0:
            raise ValueError("per_round and cap must be >= 0")
        self.per_round, self.cap = per_round, cap
        self._left: dict[str, float] = {}  # key (peer id or STRANGERS) -> allowance left, for those below the cap

    def allowance(self, peer: str, met: Callable[[str], bool]) -> float:
        """Seconds a group we lead may wait for ``peer`` past its quorum now."""
        return self._left.get(judged_as(peer, met), self.cap)

    def settle(self, waited: Mapping[str, float], met: Callable[[str], bool], live: Iterable[str]) -> None:
        """Learns from a round we led: ``waited`` is :func:`waits`' last answer (seconds per peer it expected).
        Each peer's allowance loses what the round waited for it and gains ``per_round``, within [0, ``cap``];
        strangers together lose the longest wait among them. Peers no longer ``live`` are forgotten (one that comes
        back starts with the whole allowance)."""
        spent: dict[str, float] = {}
        for peer, seconds in waited.items():
            key = judged_as(peer, met)
            spent[key] = max(spent.get(key, 0.0), seconds)
        for key, seconds in spent.items():
            left = min(self.cap, max(0.0, self._left.get(key, self.cap) - seconds) + self.per_round)
            if left < self.cap:
                self._left[key] = left
            else:
                self._left.pop(key, None)
        keep = set(live) | {STRANGERS}
        self._left = {k: v for k, v in self._left.items() if k in keep}
        if len(self._left) > MAX_TRACKED:
            self._left = dict(list(self._left.items())[-MAX_TRACKED:])
