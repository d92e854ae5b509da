"""The engine's transport over the swarm (:class:`peer.outer.rounds.Transport`).

It depends on the swarm alone, never on the trainer: the engine passes what it knows into :meth:`launch`
(its expected round), whether and why a round was not launched comes back only in the round's outcome
(status ``alone`` or ``behind``, decided by :func:`peer.net.policy.consensus.launch_verdict`), and the live peer
count is a read-only property.
"""

from __future__ import annotations

import concurrent.futures
from typing import Optional

import torch

from peer.net.policy.consensus import launch_verdict, live_count
from peer.net.swarm import Swarm
from peer.outer.rounds import RoundOutcome


class Done:
    """The handle of a round that ended before it started (not launched: the outcome says why)."""

    def __init__(self, outcome: RoundOutcome):
        self.outcome = outcome

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        return self.outcome

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False


class SwarmTransport:
    """Launches rounds in ``swarm``. ``sync_every`` is the steps schedule's H (None on the clock schedule):
    the phase rules of :mod:`peer.net.policy.consensus` then apply to its rounds.

    Must be created after ``swarm.start()``."""

    def __init__(self, swarm: Swarm, *, min_group_size: int, sync_every: Optional[int] = None):
        self.swarm = swarm
        self.min_group_size = min_group_size
        self.sync_every = sync_every

    @property
    def live_count(self) -> int:
        """Live peers of this run, us included, as of the last heartbeat (never blocks)."""
        return self.swarm.live_count()

    def launch(self, *, fragment: int, round_: int, delta: torch.Tensor, weight: float, step: int,
               expected_round: int, base: "concurrent.futures.Future[tuple[int, str]]"):
        records, me = self.swarm.live_peers(), self.swarm.peer_id  # as of the last heartbeat: never blocks
        verdict = launch_verdict(records, me, vouched=self.swarm.vouched_peers(), fragment=fragment, round_=round_,
                                 expected_round=expected_round, min_group_size=self.min_group_size,
                                 mine=self.swarm.ours.held(fragment))
        if verdict is not None:
            status, why = verdict
            return Done(RoundOutcome(fragment, round_, status, group_size=1, error=why))
        return self.swarm.run_round(fragment=fragment, round_=round_, delta=delta, weight=weight, base=base,
                                    inner_step=step,
                                    target_group_size=live_count(records, me),
                                    sync_every=self.sync_every)
