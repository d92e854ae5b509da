"""Whether this peer keeps the swarm's pace, told to its owner when it does not (pure: no I/O).

A member whose link is too slow for the run's rounds misses one, downloads the swarm's state, falls behind again
while it downloads, and downloads again; each line it logs is true and none says what is going on.
:class:`PaceWatch` notices the pattern and says it once, with what the owner and the operator can do. Since the
last round that averaged something, either ``ROUNDS`` rounds averaged nothing with ``DOWNLOADS`` or more state
downloads among them, or the peer went to catch up ``CATCH_UPS`` times. It is said only when our measured uplink
is under ``SLOW_LINK`` of the other live peers' median declared uplink (or not measured yet) and the streak's
downloads were not quick (median ``QUICK_S`` or more). Why these conditions: docs/architecture.md, "Before
joining, and what the user sees".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from peer.outer.rounds import RoundStatus

ROUNDS = 8  # rounds in a row (any fragment) that averaged nothing, before the peer is said to be out of pace
DOWNLOADS = 2  # state downloads among them: a peer that is merely alone or unmatched is not out of pace
CATCH_UPS = 3  # or this many catch-ups with no round averaged between them, whatever the round count
SLOW_LINK = 0.5  # our uplink under this share of the others' median declared uplink: ours is the slow link
QUICK_S = 2.0  # state downloads whose median took under this (s) are no sign of a slow link


@dataclass
class PaceWatch:
    """Fed from the training thread: :meth:`round` with every round's status, :meth:`caught_up` after every
    catch-up. :meth:`verdict` says it once per streak."""

    schedule: str  # "steps" or "clock": what the operator can change differs
    rounds: int = ROUNDS
    downloads: int = DOWNLOADS
    catch_ups: int = CATCH_UPS
    _missed: int = 0  # rounds in a row that applied nothing
    _download_seconds: list[float] = field(default_factory=list)  # the streak's state downloads
    _catch_ups: int = 0  # the streak's catch-ups (each planned a download of one fragment or more)
    _said: bool = False

    def round(self, status: RoundStatus) -> None:
        """One round ended with ``status``; one that applied something (ok, partial) ends a streak."""
        if RoundStatus(status).averaged:
            self._missed, self._download_seconds, self._catch_ups, self._said = 0, [], 0, False
        elif status != RoundStatus.ALONE:  # alone: nobody to keep pace with
            self._missed += 1

    def caught_up(self, seconds: list[float], failed: int = 0) -> None:
        """One catch-up ended: its state downloads (one per fragment delivered) took ``seconds``; ``failed``
        planned downloads delivered nothing."""
        if not seconds and not failed:
            return
        self._catch_ups += 1
        self._download_seconds.extend(seconds)
        del self._download_seconds[:-64]  # (the streak's last ones: bounded)

    @property
    def out_of_pace(self) -> bool:
        return ((self._missed >= self.rounds and len(self._download_seconds) >= self.downloads)
                or self._catch_ups >= self.catch_ups)

    def verdict(self, uplink_bytes_per_second: float = 0.0, others_uplinks: Sequence[float] = ()) -> Optional[str]:
        """What to tell the owner (one line), the first time this streak is out of pace and our link is the slow
        one; else None. ``uplink_bytes_per_second``: our measured uplink (0: not measured); ``others_uplinks``: the
        uplinks the other live peers' records declare (0s, not measured, are left out). The upper median: where half
        the swarm is as slow as we are, the other half sets the pace."""
        if self._said or not self.out_of_pace:
            return None
        known = sorted(u for u in others_uplinks if u > 0)
        if uplink_bytes_per_second > 0 and known and uplink_bytes_per_second >= SLOW_LINK * known[len(known) // 2]:
            return None  # (not our link: the donors', or the swarm's; the catch-up lines say what failed)
        times = sorted(self._download_seconds)
        median = times[len(times) // 2] if times else None
        if median is not None and median < QUICK_S:
            return None  # (quick downloads: we caught up at once, the swarm's rounds moved on without us)
        self._said = True
        took = f", median {median:.0f} s each" if median is not None else ""
        link = f"; its measured uplink is {uplink_bytes_per_second * 8 / 1e6:.1f} Mbit/s" \
            if uplink_bytes_per_second > 0 else ""
        fix = ("a larger outer.sync_every, or outer.schedule = \"clock\" (the swarm's pace is then wall time)"
               if self.schedule == "steps" else "a longer outer.round_seconds")
        return (f"this peer is not keeping the swarm's pace: its last {self._missed} rounds averaged nothing and it "
                f"went to download the swarm's state {self._catch_ups} times ({len(times)} fragments delivered"
                f"{took}), while the swarm went on{link}. Its link is likely too slow "
                f"for this run's rounds: it keeps training and rejoins when a round lets it; a faster link helps, and "
                f"the run's operator can choose {fix}")
