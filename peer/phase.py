"""Phase on the steps schedule: peers that reach the same round at different wall times (pure).

On the steps schedule a round is due at a local step count, so two peers meet only if they reach that
step at about the same wall time. A restart, a pause (a laptop that sleeps, SIGSTOP) or a round that
blocked one peer longer than another (one waited for a dead reducer's span) leaves peers *out of
phase*: each reaches every round after the other gave up waiting, and with two peers they never meet
again. Three rules bring them back, all read from the progress records (a record carries its owner's
step, its applied round per fragment, and the rounds it is looking for a group for, ``seeking``):

- **Patience** (the peer ahead yields): a peer whose search found no group keeps searching, for up to
  ``swarm.matchmaking_patience`` seconds more, while a live peer's record shows that it has not yet
  reached the step at which this round was launched (:func:`laggards`): that peer is behind by wall
  time and on its way. Once they meet, both resume from the same round at the same moment: in phase.
- **Realignment** (the peer far behind moves up): a peer whose step is further behind the swarm's lead
  than patience can cover moves its step counter up to just before the latest sync the lead has reached
  (:func:`realign`), so it launches that round next, while the lead is still looking for it. Nothing
  of its training is lost: the progress of every fragment stays in ``S - theta`` and goes into the
  fragment's next round, weighted by its tokens. A peer never moves back by this rule, and it never
  follows a peer whose state is two or more rounds behind its own (that peer ran on alone during an
  outage; it downloads the swarm's state and moves back itself, see ``Trainer._catch_up``).
- **Giving up early**: a search ends at once when every other live peer has left its round without it
  (:func:`nobody_coming`), e.g. a round launched from a record a heartbeat old.

The bound these give (three rounds of each fragment) is derived and measured in docs/architecture.md,
"Phase on the steps schedule".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from peer.progress import ProgressRecord
from peer.schedule import last_sync_step, next_sync_step, sync_step


def laggards(records: Mapping[str, ProgressRecord], me: str, launch_step: int) -> list[str]:
    """Live peers (ids, sorted) whose newest record shows they have not reached ``launch_step`` yet: the
    step at which this peer launched the round it is looking for a group for."""
    return sorted(pid for pid, rec in records.items() if pid != me and rec.step < launch_step)


def nobody_coming(records: Mapping[str, ProgressRecord], me: str, *, launch_step: int, fragment: int,
                  round_: int) -> Optional[str]:
    """Why no peer will come to round ``round_`` of ``fragment`` (launched at ``launch_step``), or None.

    Every other live peer's record shows it past ``launch_step`` and not looking for a group for that round
    (its ``seeking``), without the round applied (that case is :func:`~peer.state_transfer.swarm_is_past`):
    each has left the round without us, alone or with a group that is over. Typical right after a
    realignment from a record a heartbeat old: we launched a round the lead had just left; waiting
    ``matchmaking_timeout`` in it would only delay meeting the lead at the round it now waits in.
    """
    others = [rec for pid, rec in records.items() if pid != me]
    if others and all(rec.step > launch_step and [fragment, round_] not in rec.seeking
                      and (len(rec.rounds) <= fragment or rec.rounds[fragment] < round_) for rec in others):
        return "every live peer has left this round without it"
    return None


def in_step_with(rec: ProgressRecord, my_rounds: Sequence[int]) -> bool:
    """Whether ``rec``'s peer can set the phase for us: its state is at most one round behind ours in every
    fragment (a peer that advertises a round a moment late is still in the same phase; one that is two or
    more behind trained alone and will download the swarm's state and move back)."""
    return len(rec.rounds) == len(my_rounds) and all(r >= m - 1 for r, m in zip(rec.rounds, my_rounds))


@dataclass(frozen=True)
class Realignment:
    """Move the step counter from ``behind_steps`` behind ``lead``'s up to ``step``."""

    step: int
    lead: str
    behind_steps: int


def projected_step(rec: ProgressRecord, *, now: float, step_seconds: Optional[float], H: int,
                   num_fragments: int) -> int:
    """Where ``rec``'s peer probably is at DHT time ``now``, as far as a round is concerned: its record is up to
    a heartbeat old. A peer looking for a group is at the launch of the earliest round it seeks (we must come
    to that round). Otherwise it went on at our own step time (the steps schedule is for peers of one speed),
    but not past its next sync, where it may be blocked looking for a group; a record written at a sync step
    is taken as is (it may be blocked there)."""
    if rec.seeking:  # (never past its own step: it launched them)
        return min([rec.step] + [sync_step(p, r, num_fragments, H) for p, r in rec.seeking])
    if step_seconds is None or step_seconds <= 0 or last_sync_step(rec.step, num_fragments, H) == rec.step:
        return rec.step
    ahead = int(max(0.0, now - rec.time) / step_seconds)
    return min(rec.step + ahead, next_sync_step(rec.step, num_fragments, H))


def realign(records: Mapping[str, ProgressRecord], me: str, *, my_step: int, my_rounds: Sequence[int],
            step_seconds: Optional[float], min_lag_seconds: float, H: int, num_fragments: int, now: float
            ) -> Optional[Realignment]:
    """Where to move our step counter (steps schedule) so that we launch the swarm's current round, or None.

    The lead is the live peer in step with us (:func:`in_step_with`) that is furthest ahead (at its
    :func:`projected_step`, DHT time ``now``). We move up when we are at least ``min_lag_seconds`` behind it
    at our own ``step_seconds`` (a shorter lag is covered by the lead's patience), or a whole ``H`` steps
    behind (also while our step time is not measured yet). The new step is just before the latest sync step
    the lead has reached, so that sync is our next launch: never past it (we would skip the round the lead
    is looking for a group for), never back.
    """
    leads = [(projected_step(rec, now=now, step_seconds=step_seconds, H=H, num_fragments=num_fragments), rec.peer_id)
             for pid, rec in records.items() if pid != me and in_step_with(rec, my_rounds)]
    if not leads:
        return None
    lead_step, lead = max(leads)
    behind = lead_step - my_step
    target = last_sync_step(lead_step, num_fragments, H) - 1
    far = behind >= H or (step_seconds is not None and behind * step_seconds >= min_lag_seconds)
    if target <= my_step or not far:
        return None
    return Realignment(step=target, lead=lead, behind_steps=behind)
