"""Who a group waits for: the live peers expected at a round, and those that stayed away (pure: no I/O).

A live record is not a peer that comes (a crashed or hung peer's, or made-up ids'). A group assembles once those
:meth:`Attendance.expected` names joined (any other live peer that comes before is welcome). Not waited for:

- a peer whose state is well behind ours (:func:`catching_up`): it downloads the swarm's state before it comes;
- a peer *absent* here: invited to ``MISSES`` rounds in a row, of any fragment or of this one, it came to none
  (:meth:`Attendance.record`). It is invited again at probes whose interval doubles up to ``MAX_INTERVAL`` rounds,
  and at once when its record says it seeks the round or caught up with our state, until ``CLAIMS`` such
  invitations went unanswered; joining a group of ours (of that fragment) forgives it.

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
CLAIMS = 2  # invitations an absent peer's record won it (not a probe) and it did not come, before only probes do
ANY = -1  # the scope of rounds of every fragment (a fragment's own scope is its index)
MAX_TRACKED = 4096  # peers remembered (a record per live id; ids that are no longer live are forgotten)


def judged_as(peer: str, met: Callable[[str], bool]) -> str:
    """Under which key ``peer`` is judged: its id if we were in a group with it (``met``), else
    :data:`STRANGERS` (fresh ids cost nothing: per-id bookkeeping would be theirs to inflate)."""
    return peer if met(peer) else STRANGERS


@dataclass
class _Absence:
    missed: int = 0  # rounds in a row it was invited to and did not come
    skipped: int = 0  # rounds since it was last invited (while absent)
    apart: bool = False  # its record showed another state than ours since its last miss (see _caught_up)
    claims: int = 0  # misses at rounds its record invited it to (not probes), since it last came


@dataclass(frozen=True)
class Absent:
    """``who`` (a peer id, or :data:`STRANGERS`) stopped being waited for at this round, and why."""

    who: str
    why: str


class Attendance:
    """Whom this peer's rounds wait for. A peer is judged in two scopes: the rounds of every fragment (one that
    crashed misses them all, and is absent after ``misses`` rounds, whichever fragments they were) and each
    fragment's own rounds (one that comes to one fragment's groups and never to another's, a hostile leader of its
    own groups there, is absent in that fragment: the other scope alone forgives it at every round it comes to). A
    round waits for a peer unless it is absent in either scope and no probe is due there. One writer, the swarm on
    its event loop (:class:`~peer.net.swarm.Swarm`): :meth:`observe` at each read of the records, :meth:`record` and
    :meth:`no_group` when a round hands back whom it invited; :meth:`expected` and :meth:`counted` only read."""

    def __init__(self, *, misses: int = MISSES, max_interval: int = MAX_INTERVAL, claims: int = CLAIMS):
        if misses < 1 or max_interval < 1 or claims < 0:
            raise ValueError("misses and max_interval must be >= 1, claims >= 0")
        self.misses, self.max_interval, self.claims = misses, max_interval, claims
        # (who, scope) -> its record, for those that missed at least once; scope: ANY or a fragment
        self._absence: dict[tuple[str, int], _Absence] = {}

    def _scoped(self, key: str, fragment: Optional[int]) -> list[_Absence]:
        """``key``'s records in the scopes that judge a round of ``fragment`` (None: every fragment's only)."""
        scopes = (ANY,) if fragment is None else (ANY, fragment)
        return [a for s in scopes if (a := self._absence.get((key, s))) is not None]

    def _due(self, a: _Absence) -> bool:
        """Whether a round in that record's scope invites its peer: it is not absent there, or a probe is due."""
        return a.missed < self.misses or a.skipped + 1 >= min(self.max_interval, 2 ** (a.missed - self.misses + 1))

    def expected(self, records: Mapping[str, ProgressRecord], me: str, my_rounds: Sequence[int],
                 met: Callable[[str], bool], here: tuple[int, int]) -> frozenset[str]:
        """The peers (ids, us included) round ``here`` = (fragment, round) waits for: live (``records``: unpaused,
        admitted), not catching up (:func:`catching_up` against ``my_rounds``, our applied round per fragment),
        and not absent here, unless probed this round or, for a peer we were in a group with (``met``) that left
        fewer than ``claims`` such invitations unanswered, its record says it is looking for a group for this very
        round, or it came back to our state (:meth:`observe`)."""
        seeking, fragment = list(here), here[0]

        def invited(pid: str, rec: ProgressRecord) -> bool:
            scoped = self._scoped(judged_as(pid, met), fragment)
            if all(self._due(a) for a in scoped):
                return True
            return met(pid) and all(a.claims < self.claims for a in scoped) and (
                seeking in rec.seeking or self._caught_up(rec, my_rounds, scoped))
        return frozenset({me} | {pid for pid, rec in records.items() if pid != me
                                 and not catching_up(rec, my_rounds) and invited(pid, rec)})

    def observe(self, records: Mapping[str, ProgressRecord], my_rounds: Sequence[int]) -> None:
        """Notes, of each absent partner, whether its record (``records``: the live ones, as just read) shows another
        state than ours (``my_rounds``): what :meth:`expected` needs to tell that it came back to our state."""
        for (pid, _), a in self._absence.items():
            rec = records.get(pid)
            if rec is not None and not _near(rec, my_rounds):
                a.apart = True

    def _missed(self, key: str, fragment: int, why: str) -> list[Absent]:
        """Notes that ``key``, invited to a round of ``fragment``, did not come; returns it if it became absent."""
        became = []
        for scope in (ANY, fragment):
            a = self._absence.setdefault((key, scope), _Absence())
            if not self._due(a):  # (invited by its record's claim, not at a probe)
                a.claims += 1
            a.missed, a.skipped, a.apart = a.missed + 1, 0, False
            if a.missed == self.misses and (scope == ANY or not self.absent(key)):
                where = "" if scope == ANY else f" of fragment {fragment} (it comes to the other fragments')"
                became.append(Absent(key, why.format(n=a.missed, where=where)))
        return became

    def no_group(self, *, invited: frozenset[str], live: Iterable[str], me: str, met: Callable[[str], bool],
                 fragment: int) -> list[Absent]:
        """Learns from a round of ``fragment`` which assembled no group of ours: the strangers it waited for
        (``invited``: the round's last answer from :meth:`expected`) stayed away. Partners are judged only by groups
        that assembled.

        Without this, made-up ids that never come would be waited for, and counted in every quorum, for ever:
        a round that cannot reach a quorum with them counted assembles no group, and so never records them."""
        if not any(pid in invited and pid != me and not met(pid) for pid in live):
            return []
        return self._missed(STRANGERS, fragment, "invited to {n} rounds{where} in a row that assembled no group, came "
                                                 "to none: groups no longer wait for them or count them in a quorum "
                                                 f"(invited again within {self.max_interval} rounds)")

    def counted(self, expected: frozenset[str], me: str, met: Callable[[str], bool], fragment: int
                ) -> frozenset[str]:
        """Of the peers a round of ``fragment`` waits for (:meth:`expected`), those its quorum counts
        (:func:`~peer.net.policy.agreement.quorum_peers`): all but strangers while strangers are absent (invited at
        probes only). Counted at a probe, ids that never come would make that round a minority."""
        if not self.absent(STRANGERS, fragment):
            return expected
        return frozenset(p for p in expected if p == me or met(p))

    def _caught_up(self, rec: ProgressRecord, my_rounds: Sequence[int], scoped: list[_Absence]) -> bool:
        """Whether an absent partner (its records ``scoped``) and we have just come to one state: its record
        ``rec`` showed rounds two or more from ours since its last miss (behind or ahead) and now holds ours (one
        side downloaded the other's state: a partition healed, an outage ended). Each side waits for the other again,
        so the two meet at the next round instead of each going on in its own groups. A record that never moves (a
        stuck process) does not catch up; one that caught up and still does not come is a miss, and must drift apart
        and catch up again to be waited for outside probes. (Apart is noted by :meth:`observe`.)"""
        return any(a.apart for a in scoped) and _near(rec, my_rounds)

    def absent(self, who: str, fragment: Optional[int] = None) -> bool:
        """Whether ``who`` (a peer id or :data:`STRANGERS`) is absent now (invited at probes only) from the rounds
        of every fragment, or, with ``fragment``, from that fragment's."""
        return any(a.missed >= self.misses for a in self._scoped(who, fragment))

    def record(self, *, invited: frozenset[str], live: Iterable[str], came: Collection[str], me: str,
               met: Callable[[str], bool], fragment: int) -> list[Absent]:
        """Learns from a round's group that assembled, of ``fragment``: ``live`` are the live peers, ``came`` the
        group's members. Call once per group that holds every member we could have met (one group of all; not a level
        of bounded groups). Returns who became absent at this round (for the log and the events).

        ``invited``: the round's last answer from :meth:`expected` (when the group assembled); a peer was invited
        if it names it. Not what :meth:`expected` would say now: a peer whose
        record seeks the round only after the group assembled without it came *late* (a peer back from an
        outage, a little out of phase), and counting that as a miss would double its probe interval at every
        round it is late, so that it is never waited for again. It is not invited, so its probes come on time;
        at a probe the group waits for it."""
        # While strangers are absent, a stranger that came speaks for itself only (it is a partner from now on):
        # forgiving them all would let made-up ids that never come be waited for again, and counted, whenever
        # honest peers meet for the first time or one more fresh id of the attacker's comes to a group.
        strangers_absent = self.absent(STRANGERS, fragment)

        def key_of(pid: str) -> str:
            return pid if strangers_absent and pid in came else judged_as(pid, met)
        keys: dict[str, list[str]] = {}
        for pid in live:
            if pid != me:
                keys.setdefault(key_of(pid), []).append(pid)
        for pid in set(came) - {me}:  # one that came is forgiven here (strangers too, while not absent)
            for scope in (ANY, fragment):
                self._absence.pop((key_of(pid), scope), None)
                self._absence.pop((pid, scope), None)
        became = []
        for key, pids in keys.items():
            if any(p in came for p in pids):
                continue
            if any(p in invited for p in pids):  # invited, and none came
                became += self._missed(key, fragment, "invited to {n} rounds{where} in a row, came to none: groups "
                                                      "no longer wait for it there (it is still welcome, and invited "
                                                      f"again within {self.max_interval} rounds)")
                continue
            for scope in (ANY, fragment):
                if (a := self._absence.get((key, scope))) is not None:
                    a.skipped += 1
        # forget peers no longer live (a peer that comes back after its record expired starts afresh), and the
        # strangers' absence once no stranger that stayed away is live (newcomers then start afresh too)
        self._absence = {k: v for k, v in self._absence.items() if k[0] in keys}
        if len(self._absence) > MAX_TRACKED:
            self._absence = dict(list(self._absence.items())[-MAX_TRACKED:])
        return became

    def snapshot(self, scope: int = ANY) -> dict[str, tuple[int, int]]:
        """{who: (rounds missed in a row, rounds since last invited)} in ``scope`` (:data:`ANY` or a fragment), for
        the ones that missed there (tests)."""
        return {k: (v.missed, v.skipped) for (k, s), v in self._absence.items() if s == scope}


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
