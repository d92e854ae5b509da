"""Who this peer sees in the swarm (a data structure: no I/O; the heartbeat in ``peer/net/swarm.py`` feeds it).

- **Live**: the other peers' progress records as they arrive (:class:`~peer.net.trust.progress.LiveView`), without the
  peers we excluded (:mod:`peer.net.trust.exclusion`), those without a valid pass (authenticated runs) and those their
  owners paused. Every rule acts on these: group targets, donors, votes.
- **Vouched speeds**: what their records claim over time (:class:`~peer.net.trust.progress.SpeedLedger`, the robust
  rule's caps).
- **Partners**: the peers we were in a group with, and the host each was met from; their records, one per host, are
  the ones the consensus rules trust (:meth:`Roster.vouched_peers`), and whom a round waits for tells them from
  strangers (peer/net/view/attendance.py).
- **Known**: the peers we saw lately, pinged when we find ourselves alone.
- **Arrivals**: the peers that came into view at the last read (:meth:`Roster.merge`), greeted by the heartbeat.

Read from the training thread (never blocks) and written by the networking thread: each update swaps in a new
dict.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from hivemind.utils.crypto import RSAPublicKey

from peer.net.flow.streams import UNRESOLVED, HostBook
from peer.net.policy.agreement import partners
from peer.net.trust.claims import peer_key
from peer.net.trust.exclusion import Exclusions
from peer.net.trust.progress import LiveView, SpeedLedger
from peer.net.trust.records import ProgressRecord

# Peers remembered to reconnect to when we find ourselves alone: the most recently seen, for an hour.
MAX_KNOWN_PEERS, KNOWN_PEER_TTL = 64, 3600.0
MAX_PARTNERS = 1024  # peers we were in a group with, remembered for KNOWN_PEER_TTL (see vouched_peers)
# Arrivals returned by one merge. Each costs a ping: a host minting identities buys no more than this per beat.
# Those left over are returned by the next merges (if still live), in a random order behind our partners: an
# honest joiner among a crowd of identities is greeted within a few beats, wherever the crowd's records sort.
MAX_ARRIVALS = 8
# State downloads in a row a donor may fail for a reason other than a lie or "no such state" (busy, an error answer,
# a cut stream, its deadline) before its records are no vote for their lifetime (Roster.donor_failed).
MAX_DONOR_FAILURES = 3


class Roster:
    """``admitted(peer)``: whether it may take part (authenticated runs: its pass; always true in an open run);
    ``exclusions``: the peers we no longer work with; ``clock``: monotonic seconds (tests pass their own).
    Written by the heartbeat (:meth:`merge`) and the swarm's lessons (:meth:`met`, :meth:`unheld`,
    :meth:`donor_failed`, :meth:`donor_served`), both in the networking thread."""

    def __init__(self, *, ttl: float, exclusions: Exclusions, admitted: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic, hosts: Optional[HostBook] = None):
        self.view = LiveView(ttl)  # everyone's records, merged by the heartbeat
        self.speeds = SpeedLedger()  # the speeds their records vouch for (the robust rule's caps)
        self.exclusions, self.admitted = exclusions, admitted
        self._known: dict[str, float] = {}  # peer id -> when we last saw it live (pinged when we are alone)
        self._partners: dict[str, float] = {}  # peer id -> when we last were in a group with it
        self._partner_hosts: dict[str, Optional[str]] = {}  # partner id -> its host when last resolved
        self._ttl = ttl
        # peer id -> (until when its records are no vote, the fragment and round it did not serve; None: any)
        self._unheld: dict[str, tuple[float, Optional[tuple[int, int]]]] = {}  # (:meth:`unheld`)
        self._failures: dict[str, int] = {}  # donor id -> state downloads it failed in a row (:meth:`donor_failed`)
        self._handed: frozenset[str] = frozenset()  # live others already handed out as arrivals
        self._shuffle = random.Random().shuffle
        self._clock = clock
        self.hosts = hosts  # whom our daemon holds connections with, and their hosts (None: every record anchors)
        self._me = ""  # our own id (the merges say it)

    def merge(self, found, *, dht_now: float, me: str,
              accept: Optional[Callable[[bytes, ProgressRecord], bool]] = None) -> list[str]:
        """Adds one read of the records (``dht.get(progress_key, latest=True)``; see :meth:`LiveView.merge`).

        Returns the arrivals: other peers live now and not at the previous merge (a joiner, or a peer back
        after its link was down), at most MAX_ARRIVALS, our partners first, the rest in a random order; those
        left over come at the next merges while they stay live. The caller dials them: a peer
        whose link was down has its own dials to us refused by libp2p's dial backoff for a while after its
        link returns, while ours to it, stopped since its record expired, are not."""
        now, self._me = self._clock(), me
        if found is not None:
            self.view.merge(found, dht_now=dht_now, local_now=now, accept=accept)
            self.speeds.observe(self.view.live(now), now)
        others = [pid for pid in self.live_peers() if pid != me]
        known = {**self._known, **{pid: now for pid in others}}
        self._known = dict(sorted((kv for kv in known.items() if kv[1] + KNOWN_PEER_TTL >= now),
                                  key=lambda kv: kv[1])[-MAX_KNOWN_PEERS:])
        arrived = [pid for pid in others if pid not in self._handed]
        self._shuffle(arrived)
        arrived = sorted(arrived, key=lambda p: not self.partnered(p))[:MAX_ARRIVALS]
        self._handed = frozenset(p for p in others if p in self._handed).union(arrived)
        self._note_hosts(self._partners)
        return arrived

    def ungreeted(self, me: str) -> list[str]:
        """The other live peers whose records do not anchor yet (:meth:`anchored`: our daemon lists no connection with
        them) and that no merge has handed out as arrivals to greet (a crowd of identities is handed out MAX_ARRIVALS a
        read); none without ``hosts`` (every record anchors)."""
        if self.hosts is None:
            return []
        return [pid for pid in self.live_peers()
                if pid != me and pid not in self._handed and self.hosts.host(pid) == UNRESOLVED]

    def key_of(self, peer: str) -> Optional[RSAPublicKey]:
        """``peer``'s identity key, as the signature of its newest record we hold names it (None: none held). Any
        thread."""
        owner = self.view.owner(peer)
        return None if owner is None else peer_key(owner, peer)

    def live_peers(self) -> dict[str, ProgressRecord]:
        """Progress records of the peers of this run heard from within ``progress_ttl``, without the peers we
        excluded (they count for no group, no state download and no vote), those without a valid pass and those
        paused by their owners."""
        return {pid: rec for pid, rec in self.view.live(self._clock()).items()
                if pid not in self.exclusions and self.admitted(pid) and not rec.paused}

    def paused_peers(self, me: str) -> list[str]:
        """Ids of the peers of this run whose live records say they are paused (not in :meth:`live_peers`)."""
        return sorted(pid for pid, rec in self.view.live(self._clock()).items()
                      if rec.paused and pid != me and self.admitted(pid))

    def vouched_peers(self) -> dict[str, ProgressRecord]:
        """The live records the consensus rules may act on (the swarm's state to adopt, whether a round is late,
        where the swarm's step is): those of the peers we were in a group with within ``KNOWN_PEER_TTL``, one
        per host (:meth:`partner_votes`), when any of them is live; otherwise (a peer that has met no one yet: a
        joiner, or every peer of a new swarm) those of the peers our daemon holds a connection with, one per host
        (:meth:`anchored`), and ours.

        A record is self-declared: one host can publish records under many made-up ids (sybils), each claiming a
        "majority" state or a round far ahead. Invariant: such claims move nothing unless their ids took part in
        our rounds (where their parts are clipped and they can be excluded) or, before any round, a daemon answers
        for them; either way one host is one vote, however many of its ids sat in our groups. (Whom a round waits
        for is :mod:`peer.net.view.attendance`'s call: a newcomer has met no one, and a group that never waited
        for it would rarely let it in.)"""
        every = self.live_peers()
        live = {pid: rec for pid, rec in every.items() if not self._muted(pid, every)}
        return self.partner_votes(live) or self.anchored(live)

    def unheld(self, peer: str, asked: Optional[tuple[int, int]] = None) -> None:
        """``peer``, asked for the state its record advertised (``asked``: that fragment and round; None: a state
        it never delivers, :meth:`donor_failed`), said it holds none: its records are no vote (:meth:`vouched_peers`)
        for the records' ``ttl``. A record that claims the swarm far ahead, or a state it cannot serve, would
        otherwise keep every catch-up failing and every round ``behind``. An honest peer serves its last two states,
        so it says this when it applied two rounds since the record we planned from (a swarm whose rounds come
        faster than its heartbeats): its vote is back once its record shows a later state of that fragment that
        another vote holds too (:meth:`_muted`); a record far ahead, held by no other vote, stays no vote."""
        now = self._clock()
        kept = {p: mark for p, mark in self._unheld.items() if mark[0] > now}
        kept[peer] = (now + self._ttl, asked)
        self._unheld = dict(sorted(kept.items(), key=lambda kv: kv[1][0])[-MAX_PARTNERS:])

    def _muted(self, peer: str, live: dict[str, ProgressRecord]) -> bool:
        """Whether ``peer``'s record is no vote now (:meth:`unheld`): marked within ``ttl``, and, where the mark
        names the state it did not serve, its record not yet at a later state of that fragment that a vote of
        another peer (:meth:`partner_votes`, else :meth:`anchored`, without ``peer``) also holds."""
        until, asked = self._unheld.get(peer, (0.0, None))
        if until <= self._clock():
            return False
        rec = live.get(peer)
        if asked is None or rec is None:
            return True
        fragment, round_ = asked
        if len(rec.rounds) <= fragment or len(rec.digests) <= fragment or rec.rounds[fragment] <= round_:
            return True
        state = (rec.rounds[fragment], rec.digests[fragment])
        rest = {pid: r for pid, r in live.items() if pid != peer}
        voters = self.partner_votes(rest) or self.anchored(rest)
        return not any(pid != self._me and len(r.rounds) > fragment and len(r.digests) > fragment
                       and (r.rounds[fragment], r.digests[fragment]) == state for pid, r in voters.items())

    def donor_failed(self, peer: str) -> None:
        """``peer``, asked for a state its record advertised, failed to deliver it for a reason other than a lie or
        "no such state": busy, an error answer, a cut stream, its deadline. An honest donor does so now and then (it
        serves a few downloads at once); one whose record advertises a state it never delivers would keep every
        catch-up failing and every round ``behind``, as :meth:`unheld` says. The MAX_DONOR_FAILURES-th failure in a
        row (no :meth:`donor_served` between) makes it unheld."""
        failures = self._failures.pop(peer, 0) + 1
        if failures >= MAX_DONOR_FAILURES:
            self.unheld(peer)  # (whatever state: it delivered none)
        else:
            self._failures = dict(list({**self._failures, peer: failures}.items())[-MAX_PARTNERS:])

    def donor_served(self, peer: str) -> None:
        """``peer`` delivered a verified part of a state: its failures in a row start again from none."""
        self._failures.pop(peer, None)

    def partner_votes(self, live: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """Of ``live``: our partners' records, at most one per host (the smallest id; loopback and relayed
        partners one by one). A partner's host is the daemon's listing's, or the last one it showed while we met
        (a partner that closed its connections keeps its host); partners never resolved share one vote."""
        def host(pid: str) -> Optional[str]:
            now = self.hosts.host(pid) if self.hosts is not None else None
            return self._partner_hosts.get(pid, UNRESOLVED) if now == UNRESOLVED else now

        return self._one_per_host({pid: live[pid] for pid in partners(live, self.partnered)}, host, unresolved=True)

    def anchored(self, live: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """Of ``live``: ours, and those of peers our daemon holds a connection with (``hosts``' last listing), at
        most one per host (the smallest id; loopback and relayed peers one by one). Every record without
        ``hosts``."""
        if self.hosts is None:
            return live
        return self._one_per_host(live, self.hosts.host, unresolved=False)

    def _one_per_host(self, records: dict[str, ProgressRecord], host: Callable[[str], Optional[str]], *,
                      unresolved: bool) -> dict[str, ProgressRecord]:
        """Of ``records``: ours, and the smallest id of each host (``host(pid)``; None, a loopback or relayed
        peer: each its own); peers whose host is :data:`UNRESOLVED` share one host if ``unresolved``, else none
        counts."""
        out, hosts_seen = {}, set()
        for pid in sorted(records):
            where = host(pid)
            if pid != self._me:
                if (where == UNRESOLVED and not unresolved) or where in hosts_seen:
                    continue
                if where is not None:
                    hosts_seen.add(where)
            out[pid] = records[pid]
        return out

    def meetable(self, live: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """Of ``live``: the records of peers a round may wait for, our partners and the :meth:`anchored` others
        (ninety made-up ids invited to a new swarm's first round put its quorum out of reach)."""
        anchored = self.anchored(live)
        return {pid: rec for pid, rec in live.items() if pid in anchored or self.partnered(pid)}

    def partnered(self, peer: str) -> bool:
        """Whether we were in a group with ``peer`` within ``KNOWN_PEER_TTL`` (else it is a stranger to us)."""
        seen = self._partners.get(peer)
        return seen is not None and seen + KNOWN_PEER_TTL >= self._clock()

    def met(self, peers: set[str]) -> None:
        """Remembers the members of a group we assembled with (at most MAX_PARTNERS, the latest), and their
        hosts."""
        now = self._clock()
        self._partners = dict(sorted({**self._partners, **{p: now for p in peers}}.items(),
                                     key=lambda kv: kv[1])[-MAX_PARTNERS:])
        self._note_hosts(peers)

    def _note_hosts(self, peers) -> None:
        """Remembers the host of each of ``peers`` the daemon's listing resolves now (partners only)."""
        if self.hosts is None:
            return
        hosts = {p: h for p in peers if p in self._partners and (h := self.hosts.host(p)) != UNRESOLVED}
        self._partner_hosts = {p: h for p, h in {**self._partner_hosts, **hosts}.items() if p in self._partners}

    def known(self) -> list[str]:
        """The peers we saw live within ``KNOWN_PEER_TTL`` (at most MAX_KNOWN_PEERS, the latest)."""
        return list(self._known)
