"""Whether this peer keeps the swarm's pace, told to its owner when it does not (pure: no I/O).

A member whose link is too slow for the run's rounds misses one, finds the swarm past it, downloads the
swarm's state and, while it downloads, the swarm applies more rounds: it ends behind again and downloads
again (docs/benchmarks.md, "Uneven links": a 1 Mbit/s member on the steps schedule spent most of the run so).
Each of those lines is true and none says what is going on. :class:`PaceWatch` notices the pattern (a long run
of rounds that averaged nothing, with repeated state downloads) and says it once, with what the owner and the
operator can do about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from peer.outer.rounds import RoundStatus

ROUNDS = 8  # rounds in a row (any fragment) that averaged nothing, before the peer is said to be out of pace
DOWNLOADS = 2  # state downloads among them: a peer that is merely alone or unmatched is not out of pace


@dataclass
class PaceWatch:
    """Fed by the trainer from the training thread: :meth:`round` with every round's status,
    :meth:`caught_up` after every state download. :meth:`verdict` says it once per streak."""

    schedule: str  # "steps" or "clock": what the operator can change differs
    rounds: int = ROUNDS
    downloads: int = DOWNLOADS
    _missed: int = 0  # rounds in a row that applied nothing
    _download_seconds: list[float] = field(default_factory=list)  # the streak's state downloads
    _said: bool = False

    def round(self, status: RoundStatus) -> None:
        """One round ended with ``status``; one that applied something (ok, partial) ends a streak."""
        if status in (RoundStatus.OK, RoundStatus.PARTIAL):
            self._missed, self._download_seconds, self._said = 0, [], False
        elif status != RoundStatus.ALONE:  # alone: nobody to keep pace with
            self._missed += 1

    def caught_up(self, seconds: float) -> None:
        """A state download of one fragment took ``seconds``."""
        self._download_seconds.append(seconds)
        del self._download_seconds[:-64]  # (the streak's last ones: bounded)

    @property
    def out_of_pace(self) -> bool:
        return self._missed >= self.rounds and len(self._download_seconds) >= self.downloads

    def verdict(self, uplink_bytes_per_second: float = 0.0) -> Optional[str]:
        """What to tell the owner (one line), the first time this streak is out of pace; else None.
        ``uplink_bytes_per_second``: our measured uplink (0: not measured)."""
        if self._said or not self.out_of_pace:
            return None
        self._said = True
        seconds = sorted(self._download_seconds)[len(self._download_seconds) // 2]
        link = f"; its measured uplink is {uplink_bytes_per_second * 8 / 1e6:.1f} Mbit/s" \
            if uplink_bytes_per_second > 0 else ""
        fix = ("a larger outer.sync_every, or outer.schedule = \"clock\" (the swarm's pace is then wall time)"
               if self.schedule == "steps" else "a longer outer.round_seconds")
        return (f"this peer is not keeping the swarm's pace: its last {self._missed} rounds averaged nothing and it "
                f"downloaded the swarm's state {len(self._download_seconds)} times (median {seconds:.0f} s each), "
                f"while the swarm went on{link}. Its link is likely too slow for this run's rounds: it keeps "
                f"training and rejoins when a round lets it; a faster link helps, and the run's operator can "
                f"choose {fix}")
