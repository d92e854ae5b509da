"""Who this peer no longer works with, and why: the ledger of other peers' offences (:class:`Exclusions`).

An *offence* (:class:`Offence`) is something only a faulty or hostile peer does: a part that does not decode, has
an invalid header or that the robust rule cut hard (seen by the reducer); an average that fails a member's checks
(the member); a member info the group plan leaves out (every member). A slow or dead peer commits none: timeouts
and dropped connections are the network's, not offences.

After ``threshold`` offences (or one of a proven kind, :data:`PROVEN`) a peer is *excluded* for the rest of the run
(this process): no group target, state donor or vote in the drift check, its join requests refused, never followed
as a leader, its parts refused and its span not applied. Each peer keeps its own ledger and publishes nothing
about it (a record saying "exclude X" would be one more thing to forge).

One writer: :meth:`~peer.net.swarm.Swarm.learn` (on the networking thread) applies the verdicts that rounds, the
servicers' reductions and state downloads hand it as data; the rounds, servicers and the trainer read it.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from peer.util import short_id

log = logging.getLogger(__name__)
MAX_TRACKED = 4096  # peers with offences remembered (oldest first out); bounds what forged ids can cost us


class Offence(enum.StrEnum):
    BAD_PART = "bad_part"  # a part that does not decode, or a header with a wrong span or an invalid weight
    CLIPPED = "clipped"  # a part the robust rule cut to less than OFFENCE_CLIP of its distance from the center
    BAD_AVERAGE = "bad_average"  # a reducer's result that failed our checks (metadata, decoding, size, direction)
    BAD_INFO = "bad_info"  # a member info the group plan left out (unparsable, another protocol or size, malformed)
    BAD_STATE = "bad_state"  # a state download's part that no honest donor sends (state_transfer.DonorLied)
    # two averages of one span of one group, each with its reducer's valid signature (span_proofs): a proof, so it
    # excludes at once
    EQUIVOCATION = "equivocation"
    # valid claims of one member for two groups of one round (peer/net/trust/claims.py): a proof, since an honest
    # peer signs at most one per round, also across restarts
    TWO_GROUPS = "two_groups"


PROVEN = frozenset({Offence.EQUIVOCATION, Offence.TWO_GROUPS})  # offences one instance of which is proof enough


@dataclass(frozen=True)
class PeerVerdict:
    """What a step of a round concluded about ``peer``, as data for :meth:`Exclusions.apply`: an ``offence``
    (counts toward exclusion), else, of a reducer, whether its span ``answered`` or stayed silent while
    another reducer's came (``why`` names the fragment and round)."""

    peer: str
    why: str = ""
    offence: Optional[Offence] = None
    answered: bool = False


@dataclass
class Exclusions:
    """The offence ledger of this peer. ``on_exclude(peer, why)`` is called once per excluded peer (from the
    thread that counted the last offence). Written through :meth:`apply` by the swarm (tests also :meth:`report`),
    under the lock; read from any thread."""

    threshold: int = 3
    on_exclude: Optional[Callable[[str, str], None]] = None
    _offences: dict[str, list[str]] = field(default_factory=dict)
    _excluded: dict[str, str] = field(default_factory=dict)
    _silent: dict[str, int] = field(default_factory=dict)  # reducer -> rounds in a row its span did not come
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, peer: str, offence: Offence, detail: str) -> bool:
        """Counts one offence of ``peer`` (``detail`` names the fragment and round); True if that excluded it."""
        with self._lock:
            if peer in self._excluded:
                return False
            seen = self._offences.pop(peer, [])  # re-inserted last: the dict stays in order of last offence
            seen.append(f"{offence}: {detail}")
            self._offences[peer] = seen
            while len(self._offences) > MAX_TRACKED:
                self._offences.pop(next(iter(self._offences)))
            if len(seen) < self.threshold and offence not in PROVEN:
                return False
            why = f"{len(seen)} offences: " + "; ".join(seen[-self.threshold:])
            self._excluded[peer] = why
        log.warning("excluding peer %s for the rest of the run (%s)", short_id(peer), why)
        if self.on_exclude is not None:
            self.on_exclude(peer, why)
        return True

    def silent(self, peer: str, detail: str) -> bool:
        """A reducer whose span did not come (it timed out, refused or answered an error) while other reducers' did.
        Once is no offence (a laptop that sleeps mid-round, a link that stalls, a peer killed in the round);
        ``threshold`` rounds in a row excludes it: a reducer that holds its members' streams to the deadline, or
        answers them with errors, every round would otherwise cost its span and the round's time in every round it
        is in. True if that excluded it."""
        with self._lock:
            if peer in self._excluded:
                return False
            count = self._silent.pop(peer, 0) + 1
            self._silent[peer] = count
            while len(self._silent) > MAX_TRACKED:
                self._silent.pop(next(iter(self._silent)))
            if count < self.threshold:
                return False
            why = f"its span did not come in {count} rounds in a row while the others did (last: {detail})"
            self._excluded[peer] = why
        log.warning("excluding peer %s for the rest of the run (%s)", short_id(peer), why)
        if self.on_exclude is not None:
            self.on_exclude(peer, why)
        return True

    def answered(self, peer: str) -> None:
        """A reducer whose span arrived: its run of silent rounds is over."""
        with self._lock:
            self._silent.pop(peer, None)

    def apply(self, verdict: PeerVerdict) -> None:
        """Counts ``verdict`` (:meth:`report`, :meth:`answered` or :meth:`silent`)."""
        if verdict.offence is not None:
            self.report(verdict.peer, verdict.offence, verdict.why)
        elif verdict.answered:
            self.answered(verdict.peer)
        else:
            self.silent(verdict.peer, verdict.why)

    def __contains__(self, peer: object) -> bool:
        return str(peer) in self._excluded

    def excluded(self) -> dict[str, str]:
        """{peer id: why} of every excluded peer."""
        with self._lock:
            return dict(self._excluded)

    def offences(self, peer: str) -> int:
        with self._lock:
            return len(self._offences.get(peer, []))
