"""Who a group waits for: the live peers expected at a round, and those that stayed away (pure: no I/O).

A live record is not a peer that comes (a crashed or hung peer's, or made-up ids'). :class:`Attendance` decides
whom a round waits for (:meth:`Attendance.expected`); the group assembles as soon as those joined
(:mod:`peer.net.round.matchmaking`), and any other live peer that comes before that is still welcome. Not waited for:

- a peer whose state is well behind ours (:func:`catching_up`): it downloads the swarm's state before it comes;
- a peer *absent* here: invited to ``MISSES`` rounds in a row, it came to none (:meth:`Attendance.record`). It is
  invited again at probes whose interval doubles up to ``MAX_INTERVAL`` rounds, and at once when its record says
  it seeks the round or caught up with our state; joining a group of ours forgives it.

Peers never in a group with us are judged together, as *strangers* (:data:`STRANGERS`): fresh ids cost nothing,
so per-id bookkeeping would let sybils make every round wait; a round that assembled no group judges them too
(:meth:`Attendance.no_group`), absent strangers count in no quorum (:meth:`Attendance.counted`), and while they are
absent a stranger that comes is forgiven alone, until no stranger that stayed away is live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Optional, Sequence

from peer.net.trust.records import ProgressRecord

STRANGERS = "(strangers)"  # the key under which peers we never were in a group with are judged together
MISSES = 2  # rounds in a row a peer was invited to and did not come, before groups stop waiting for it
MAX_INTERVAL = 8  # rounds between probes of an absent peer, at most
MAX_TRACKED = 4096  # peers remembered (a record per live id; ids that are no longer live are forgotten)


@dataclass
class _Absence:
    missed: int = 0  # rounds in a row it was invited to and did not come
    skipped: int = 0  # rounds since it was last invited (while absent)
    apart: bool = False  # its record showed another state than ours since its last miss (see _caught_up)


@dataclass(frozen=True)
class Absent:
    """``who`` (a peer id, or :data:`STRANGERS`) stopped being waited for at this round, and why."""

    who: str
    why: str


class Attendance:
    """Whom this peer's rounds wait for. One ledger serves every fragment (a peer comes to all of them alike or
    to none). One writer, the swarm on its event loop (:class:`~peer.net.swarm.Swarm`): :meth:`observe` at each read
    of the records, :meth:`record` and :meth:`no_group` when a round hands back whom it invited; :meth:`expected`
    only reads."""

    def __init__(self, *, misses: int = MISSES, max_interval: int = MAX_INTERVAL):
        if misses < 1 or max_interval < 1:
            raise ValueError("misses and max_interval must be >= 1")
        self.misses, self.max_interval = misses, max_interval
        self._absence: dict[str, _Absence] = {}  # who -> its record, for those that missed at least once

    def _key(self, peer: str, met: Callable[[str], bool]) -> str:
        return peer if met(peer) else STRANGERS

    def _invited(self, key: str) -> bool:
        a = self._absence.get(key)
        if a is None or a.missed < self.misses:
            return True
        return a.skipped + 1 >= min(self.max_interval, 2 ** (a.missed - self.misses + 1))

    def expected(self, records: Mapping[str, ProgressRecord], me: str, my_rounds: Sequence[int],
                 met: Callable[[str], bool], here: tuple[int, int]) -> frozenset[str]:
        """The peers (ids, us included) round ``here`` = (fragment, round) waits for: live (``records``: unpaused,
        admitted), not catching up (:func:`catching_up` against ``my_rounds``, our applied round per fragment),
        and not absent here, unless probed this round or, for a peer we were in a group with (``met``), its
        record says it is looking for a group for this very round, or it came back to our state (:meth:`observe`)."""
        seeking = list(here)
        return frozenset({me} | {pid for pid, rec in records.items() if pid != me
                                 and not catching_up(rec, my_rounds)
                                 and (self._invited(self._key(pid, met)) or met(pid) and (
                                     seeking in rec.seeking or self._caught_up(pid, rec, my_rounds)))})

    def observe(self, records: Mapping[str, ProgressRecord], my_rounds: Sequence[int]) -> None:
        """Notes, of each absent partner, whether its record (``records``: the live ones, as just read) shows another
        state than ours (``my_rounds``): what :meth:`expected` needs to tell that it came back to our state."""
        for pid, a in self._absence.items():
            rec = records.get(pid)
            if rec is not None and not _near(rec, my_rounds):
                a.apart = True

    def no_group(self, *, invited: frozenset[str], live: Iterable[str], me: str, met: Callable[[str], bool]
                 ) -> list[Absent]:
        """Learns from a round which assembled no group of ours: the strangers it waited for (``invited``: the
        round's last answer from :meth:`expected`) stayed away. Partners are judged only by groups that assembled.

        Without this, made-up ids that never come would be waited for, and counted in every quorum, for ever:
        a round that cannot reach a quorum with them counted assembles no group, and so never records them."""
        if not any(pid in invited and pid != me and not met(pid) for pid in live):
            return []
        a = self._absence.setdefault(STRANGERS, _Absence())
        a.missed, a.skipped, a.apart = a.missed + 1, 0, False
        if a.missed != self.misses:
            return []
        return [Absent(STRANGERS, f"invited to {a.missed} rounds in a row that assembled no group, came to none: "
                                  f"groups no longer wait for them or count them in a quorum (invited again within "
                                  f"{self.max_interval} rounds)")]

    def counted(self, expected: frozenset[str], me: str, met: Callable[[str], bool]) -> frozenset[str]:
        """Of the peers a round waits for (:meth:`expected`), those its quorum counts
        (:func:`~peer.net.policy.agreement.quorum_peers`): all but strangers while strangers are absent (invited at
        probes only). Counted at a probe, ids that never come would make that round a minority."""
        return expected if not self.absent(STRANGERS) else frozenset(p for p in expected if p == me or met(p))

    def _caught_up(self, peer: str, rec: ProgressRecord, my_rounds: Sequence[int]) -> bool:
        """Whether absent partner ``peer`` and we have just come to one state: its record showed rounds two or
        more from ours since its last miss (behind or ahead) and now holds ours (one side downloaded the other's
        state: a partition healed, an outage ended). Each side waits for the other again, so the two meet at the
        next round instead of each going on in its own groups. A record that never moves (a stuck process) does
        not catch up; one that caught up and still does not come is a miss, and must drift apart and catch up
        again to be waited for outside probes. (Apart is noted by :meth:`observe`.)"""
        a = self._absence.get(peer)
        return a is not None and a.apart and _near(rec, my_rounds)

    def absent(self, who: str) -> bool:
        """Whether ``who`` (a peer id or :data:`STRANGERS`) is absent here now (invited at probes only)."""
        a = self._absence.get(who)
        return a is not None and a.missed >= self.misses

    def record(self, *, invited: frozenset[str], live: Iterable[str], came: Collection[str], me: str,
               met: Callable[[str], bool]) -> list[Absent]:
        """Learns from a round's group that assembled: ``live`` are the live peers, ``came`` the group's members.
        Call once per group that holds every member we could have met (one group of all; not a level of bounded
        groups). Returns who became absent at this round (for the log and the events).

        ``invited``: the round's last answer from :meth:`expected` (when the group assembled); a peer was invited
        if it names it. Not what :meth:`expected` would say now: a peer whose
        record seeks the round only after the group assembled without it came *late* (a peer back from an
        outage, a little out of phase), and counting that as a miss would double its probe interval at every
        round it is late, so that it is never waited for again. It is not invited, so its probes come on time;
        at a probe the group waits for it."""
        # While strangers are absent, a stranger that came speaks for itself only (it is a partner from now on):
        # forgiving them all would let made-up ids that never come be waited for again, and counted, whenever
        # honest peers meet for the first time or one more fresh id of the attacker's comes to a group.
        strangers_absent = self.absent(STRANGERS)

        def key_of(pid: str) -> str:
            return pid if strangers_absent and pid in came else self._key(pid, met)
        keys: dict[str, list[str]] = {}
        for pid in live:
            if pid != me:
                keys.setdefault(key_of(pid), []).append(pid)
        for pid in set(came) - {me}:  # a stranger that came is forgiven (and so are strangers, while not absent)
            self._absence.pop(key_of(pid), None)
            self._absence.pop(pid, None)
        became = []
        for key, pids in keys.items():
            if any(p in came for p in pids) or key not in self._absence and not any(p in invited for p in pids):
                continue
            a = self._absence.setdefault(key, _Absence())
            if any(p in invited for p in pids):  # invited, and none came
                a.missed, a.skipped, a.apart = a.missed + 1, 0, False
                if a.missed == self.misses:
                    became.append(Absent(key, f"invited to {a.missed} rounds in a row, came to none: groups no "
                                              f"longer wait for it (it is still welcome, and invited again "
                                              f"within {self.max_interval} rounds)"))
            else:
                a.skipped += 1
        # forget peers no longer live (a peer that comes back after its record expired starts afresh), and the
        # strangers' absence once no stranger that stayed away is live (newcomers then start afresh too)
        self._absence = {k: v for k, v in self._absence.items() if k in keys}
        if len(self._absence) > MAX_TRACKED:
            self._absence = dict(list(self._absence.items())[-MAX_TRACKED:])
        return became

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """{who: (rounds missed in a row, rounds since last invited)} for the ones that missed (tests)."""
        return {k: (v.missed, v.skipped) for k, v in self._absence.items()}


def _near(rec: ProgressRecord, my_rounds: Sequence[int]) -> bool:
    """Whether ``rec`` holds our state: within a round of ours in every fragment (records lag by a heartbeat, and
    a fragment's rounds can be faster than that)."""
    return len(rec.rounds) == len(my_rounds) and all(abs(r - m) <= 1 for r, m in zip(rec.rounds, my_rounds))


CATCHING_UP = 3  # rounds behind ours in some fragment: that peer downloads the swarm's state before it comes


def catching_up(rec: ProgressRecord, my_rounds: Sequence[int]) -> bool:
    """Whether ``rec``'s peer will download the swarm's state before it comes to a round: its state is
    ``CATCHING_UP`` or more rounds behind ours in some fragment. (Two behind is enough for it to download
    (:func:`~peer.net.policy.consensus.plan_catch_up`), but records lag by up to a heartbeat, and a fragment's rounds
    can be faster than that: a peer whose record is two rounds old may be at our round.) ``my_rounds`` empty
    (ours not published yet): nobody is."""
    return bool(my_rounds) and len(rec.rounds) == len(my_rounds) and any(
        r + CATCHING_UP <= m for r, m in zip(rec.rounds, my_rounds))


def early_assembly(expected: Optional[frozenset[str]], me: str, at_least: int = 2) -> Optional[frozenset[str]]:
    """The set whose arrival assembles a group early, or None (wait for the count, or ``matchmaking_time``):
    only when we expect at least one other peer, and ``at_least`` peers in all (a group that could not apply
    its round is not worth assembling early: see :func:`~peer.net.policy.agreement.quorum_size`). Expecting no one,
    we wait for whoever comes (an absent peer may be on its way; assembling with the first to arrive would
    split the others off)."""
    ok = expected is not None and any(p != me for p in expected) and len(expected) >= at_least
    return expected if ok else None
