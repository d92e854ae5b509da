"""What the operator's monitor shows, computed from the run's progress records (pure: no networking).

Every figure comes from the peers' signed records (``peer/net/trust/records.py``): who is live (a record written within
``progress_ttl``), their step, rounds, tokens/s, loss, version, whether they can be dialled (client mode) and
whether their owner paused them; per fragment, the newest round any peer applied and whether the peers at that
round hold one digest; the swarm's tokens/s (the sum over training peers) and its loss (the mean over them),
and the shared model's held-out loss (the median of what the peers at the newest evaluated round report: one
peer's word does not move it), kept as a bounded history for the chart.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from peer.net.trust.records import ProgressRecord, live_at

HISTORY_POINTS = 720  # one hour at the default 5 s poll


@dataclass(kw_only=True)
class LossHistory:
    """(time, mean loss, training peers, held-out loss or None) points, oldest first, at most ``points`` of
    them."""

    points: int = HISTORY_POINTS
    data: collections.deque = field(default_factory=collections.deque)

    def add(self, time: float, loss: Optional[float], peers: int, held_out: Optional[float] = None) -> None:
        if loss is not None:
            self.data.append((round(time, 1), round(loss, 5), peers,
                              None if held_out is None else round(held_out, 5)))
            while len(self.data) > self.points:
                self.data.popleft()


def peer_row(rec: ProgressRecord, now: float) -> dict[str, Any]:
    # (a paused peer's record keeps the rate of its last steps: it trains at none now)
    return dict(peer_id=rec.peer_id, version=rec.version or "?", step=rec.step, rounds=list(rec.rounds),
                tokens_per_second=0.0 if rec.paused else round(rec.tokens_per_second, 1), loss=rec.loss,
                eval_loss=rec.eval_loss, eval_round=rec.eval_round,
                paused=rec.paused,
                reachable=not rec.client_mode, last_seen_seconds=round(max(0.0, now - rec.time), 1))


def fragment_rows(records: Iterable[ProgressRecord]) -> list[dict[str, Any]]:
    """Per fragment: the newest round a live peer applied, how many peers are at it and whether they agree."""
    at: dict[int, dict[int, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for rec in records:
        for index, (round_, digest) in enumerate(zip(rec.rounds, rec.digests)):
            at[index][round_].append(digest)
    rows = []
    for index in sorted(at):
        newest = max(at[index])
        digests = at[index][newest]
        rows.append(dict(index=index, round=newest, peers=len(digests), digests=len(set(digests)),
                         agree=len(set(digests)) == 1))
    return rows


def held_out(records: Iterable[ProgressRecord]) -> tuple[Optional[float], int]:
    """(the shared model's held-out loss, fragment 0's round it was evaluated at): the median of the losses the
    records report for the newest evaluated round (every peer that applied the same rounds evaluates the same
    parameters); (None, 0) if none reports one."""
    reports = [(r.eval_round, r.eval_loss) for r in records if r.eval_loss is not None]
    if not reports:
        return None, 0
    newest = max(round_ for round_, _ in reports)
    return statistics.median(loss for round_, loss in reports if round_ == newest), newest


def snapshot(records: Iterable[ProgressRecord], now: float, ttl: float, history: LossHistory,
             run: dict[str, Any]) -> dict[str, Any]:
    """The JSON API's reply (``/api/swarm``) for the records at DHT time ``now``; adds a point to ``history``."""
    newest: dict[str, ProgressRecord] = {}
    for rec in records:  # one record per peer id: the newest (a peer that restarted may have two subkeys)
        if live_at(rec, now, ttl) and (rec.peer_id not in newest or rec.time > newest[rec.peer_id].time):
            newest[rec.peer_id] = rec
    live = sorted(newest.values(), key=lambda r: r.peer_id)
    training = [r for r in live if not r.paused]
    losses = [r.loss for r in training if r.loss is not None]
    loss = statistics.fmean(losses) if losses else None
    eval_loss, eval_round = held_out(live)
    history.add(now, loss, len(training), eval_loss)
    return dict(run=run, time=now, peers=[peer_row(r, now) for r in live], live_peers=len(live),
                training_peers=len(training), paused_peers=len(live) - len(training),
                tokens_per_second=round(sum(r.tokens_per_second for r in training), 1), loss=loss,
                eval_loss=eval_loss, eval_round=eval_round,
                fragments=fragment_rows(live), history=[list(p) for p in history.data])
