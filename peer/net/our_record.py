"""What our progress record says: set by the training thread, built into a record by the heartbeat.

The training thread sets what the next heartbeats publish: our step, fragment 0's round, tokens/s and last loss
(:meth:`OurRecord.update_progress`), the shared model's held-out loss (:meth:`OurRecord.publish_eval`), whether
our owner paused us (:meth:`OurRecord.publish_paused`) and each fragment's state we serve
(:meth:`OurRecord.publish_snapshot`: its round and digest, and for ``PAST_ROUNDS`` rounds after, in the record's
``past``). The heartbeat builds the record from them on ``swarm-net`` (:meth:`OurRecord.record`).

Invariant: every field is replaced whole, never changed in place, so ``swarm-net`` reads a consistent value without
a lock. A loss that is not a finite number in [0, 1e6] is not published.
"""

from __future__ import annotations

import math
from typing import Optional

from hivemind.utils import get_dht_time

from peer.net.state_transfer import ServedState, StateServicer
from peer.net.trust.records import MAX_PAST, ProgressRecord
from peer.net.view.activity import RoundActivity, RoundStage
from peer.util import VERSION

PAST_ROUNDS = 4  # rounds per fragment a record remembers (consensus.digest_at): rounds may be faster than records


class OurRecord:
    """Created by the swarm with its state servicer (which holds the snapshots we serve). Its fields are written by
    the training thread only (:meth:`update_progress`, :meth:`publish_eval`, :meth:`publish_paused`,
    :meth:`publish_snapshot`); ``swarm-net`` reads them (:meth:`record`, :meth:`applied_rounds`)."""

    def __init__(self, served: StateServicer):
        self.served = served
        # (step, round of fragment 0, tokens/s, last loss), published by the heartbeat
        self.progress: tuple[int, int, float, Optional[float]] = (0, 0, 0.0, None)
        self.eval: tuple[Optional[float], int] = (None, 0)  # the shared model's held-out loss, and its round
        self.paused = False  # set while the owner pauses the trainer
        self.past: dict[int, dict[int, str]] = {}  # fragment -> {round: digest} of our last snapshots

    def update_progress(self, step: int, round_: int, tokens_per_second: float,
                        loss: Optional[float] = None) -> None:
        """Sets what the next heartbeat publishes (cheap; call from the training loop). A loss that is not a finite
        non-negative number is not published."""
        published = float(loss) if loss is not None and math.isfinite(loss) and 0 <= loss <= 1e6 else None
        self.progress = (step, round_, float(tokens_per_second), published)

    def publish_eval(self, loss: float, round_: int) -> None:
        """Sets the shared model's held-out loss (evaluated after fragment 0's round ``round_``) that the next
        heartbeats publish (the monitor's held-out chart). A loss that is not finite and non-negative is not."""
        self.eval = (float(loss) if math.isfinite(loss) and 0 <= loss <= 1e6 else None, round_)

    def publish_paused(self, paused: bool) -> None:
        """Sets whether the next heartbeats say this peer is paused by its owner (in no group, no vote, no wait)."""
        self.paused = paused

    def publish_snapshot(self, snap: ServedState, *, adopted: bool = False) -> None:
        """Serves ``snap`` to joiners and advertises its (round, digest) with the next heartbeat (and, for
        PAST_ROUNDS rounds after, in the record's ``past``). ``adopted``: a state downloaded from the swarm,
        which replaces our earlier rounds' digests (they were of a state we left)."""
        self.served.publish(snap)
        past = {**({} if adopted else self.past.get(snap.fragment, {})), snap.round: snap.digest}
        self.past = {**self.past, snap.fragment: dict(sorted(past.items())[-PAST_ROUNDS:])}

    def recent_digests(self, num_fragments: int) -> list[dict[int, str]]:
        """Per fragment, our digests of its last PAST_ROUNDS published rounds ({round: digest}; the drift check
        compares at the latest one other records cover: consensus.plan_catch_up)."""
        past = self.past
        return [dict(past.get(p, {})) for p in range(num_fragments)]

    def held(self, fragment: int) -> Optional[tuple[int, str]]:
        """The (applied round, digest) of ``fragment`` that we serve now (None: not published yet): our vote on the
        swarm's state (consensus.swarm_state's ``mine``)."""
        snap = self.served.snapshots.get(fragment)
        return (snap.round, snap.digest) if snap is not None else None

    def applied_rounds(self) -> list[int]:
        """Our applied round per fragment, as our published snapshots say ([] before the trainer published all)."""
        snaps = self._snapshots()
        return [s.round for s in snaps if s] if all(snaps) else []

    def record(self, *, peer_id: str, activity: list[RoundActivity], client_mode: bool, pass_line: str,
               uplink: float) -> ProgressRecord:
        """Our progress record as of now (the heartbeat publishes it; called on swarm-net). ``activity``: our
        rounds in flight; ``uplink``: the one we declare (bytes/s)."""
        step, round_, tps, loss = self.progress
        snaps = self._snapshots()
        seeking = [[a.fragment, a.round] for a in activity if a.stage is not RoundStage.ALLREDUCE]
        averaging = [[a.fragment, a.round] for a in activity if a.stage is RoundStage.ALLREDUCE]
        return ProgressRecord(peer_id=peer_id, step=step, round=round_, tokens_per_second=tps, seeking=seeking,
                              averaging=averaging, paused=self.paused, loss=loss, version=VERSION,
                              client_mode=client_mode, time=get_dht_time(),
                              rounds=[s.round for s in snaps if s], digests=[s.digest for s in snaps if s],
                              past=self._past_entries(), pass_line=pass_line, eval_loss=self.eval[0],
                              eval_round=self.eval[1], upload_bytes_per_second=uplink)

    def _snapshots(self) -> list[Optional[ServedState]]:
        """Our published snapshot per fragment (None: not published yet)."""
        return [self.served.snapshots.get(p) for p in range(len(self.served.snapshots))]

    def _past_entries(self) -> list[tuple[int, int, str]]:
        """The ``past`` of our record: per fragment, its last rounds before the current one (fewer per fragment
        when there are many fragments: the record's list is bounded by MAX_PAST)."""
        past = dict(self.past)  # (replaced whole by publish_snapshot: a consistent copy)
        per_fragment = min(PAST_ROUNDS - 1, MAX_PAST // max(1, len(past)))
        return [(p, r, d) for p, rounds in sorted(past.items()) for r, d in list(rounds.items())[-1 - per_fragment:-1]]
