"""What the swarm's progress records say this peer should do (pure: no I/O, no torch).

Every decision a peer takes from the other peers' signed records lives here, so it can be tested alone:

- **The swarm's state**: per fragment, the (applied round, digest) most other peers hold (:func:`swarm_state`);
  which fragments to download (:func:`plan_catch_up`, :func:`plan_owed`); when a round must not be launched or a
  search must end because the swarm is past it (:func:`launch_gate`, :func:`swarm_is_past`); the step after a
  download (:func:`step_after_catch_up`); how many peers are live (:func:`live_count`).
- **Phase** (steps schedule): the peer ahead waits for one whose record has not reached the round's launch step
  (:func:`laggards`); the peer far behind moves its step counter up to just before the lead's latest sync
  (:func:`realign`; its progress stays in ``S - theta``; never back, never after a lead whose state is behind);
  a search ends when everyone else left the round (:func:`nobody_coming`).

The rules, their bound (three rounds of each fragment) and the measurements are in docs/architecture.md, "Phase
on the steps schedule".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from peer.net.trust.records import ProgressRecord
from peer.outer.rounds import RoundStatus
from peer.outer.schedule import last_sync_step, next_sync_step, sync_step


# ---- phase (steps schedule) ----------------------------------------------------------------------------------
def live_count(records: Mapping[str, ProgressRecord], me: str) -> int:
    """How many peers of the run ``records`` (live ones) show, ourselves always included."""
    return 1 + sum(pid != me for pid in records)


def laggards(records: Mapping[str, ProgressRecord], me: str, launch_step: int) -> list[str]:
    """Live peers (ids, sorted) whose newest record shows they have not reached ``launch_step`` yet: the
    step at which this peer launched the round it is looking for a group for."""
    return sorted(pid for pid, rec in records.items() if pid != me and rec.step < launch_step)


def nobody_coming(records: Mapping[str, ProgressRecord], me: str, *, launch_step: int, fragment: int,
                  round_: int) -> Optional[str]:
    """Why no peer will come to round ``round_`` of ``fragment`` (launched at ``launch_step``), or None.

    Every other live peer's record shows it past ``launch_step``, neither looking for a group for that round
    (its ``seeking``) nor averaging in it (its ``averaging``: its group may include us, and the leader's word
    may still be on its way over a slow link), without the round applied (that case is
    :func:`swarm_is_past`): each has left the round without us, alone or with a group
    that is over. Typical right after a realignment from a record a heartbeat old: we launched a round the
    lead had just left; waiting ``matchmaking_timeout`` in it would only delay meeting the lead at the round
    it now waits in.
    """
    others = [rec for pid, rec in records.items() if pid != me]
    here = [fragment, round_]
    if others and all(rec.step > launch_step and here not in rec.seeking and here not in rec.averaging
                      and (len(rec.rounds) <= fragment or rec.rounds[fragment] < round_) for rec in others):
        return "every live peer has left this round without it"
    return None


def in_step_with(rec: ProgressRecord, my_rounds: Sequence[int]) -> bool:
    """Whether ``rec``'s peer can set the phase for us: its state is at most one round behind ours in every
    fragment (a peer that advertises a round a moment late is still in the same phase; one that is two or
    more behind trained alone and will download the swarm's state and move back), and at most one ahead
    (further ahead, we are the one behind: the catch-up downloads the swarm's state, by the majority's word,
    not by one record's)."""
    return len(rec.rounds) == len(my_rounds) and all(m - 1 <= r <= m + 1 for r, m in zip(rec.rounds, my_rounds))


def plausible_lead(rec: ProgressRecord, H: int, num_fragments: int) -> bool:
    """Whether ``rec``'s step fits its rounds: not past the launch of fragment 0's round after next (one failed
    round in between). A step far ahead of its rounds is either a peer that trained alone (a 2-peer swarm
    while the other was away) or a forged record (it would move every peer's step, and with it the
    learning-rate schedule, to the end of the run): :func:`realign` follows it only with the others' support."""
    return bool(rec.rounds) and rec.step <= sync_step(0, rec.rounds[0] + 2, num_fragments, H)


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

    The lead is the live peer in step with us (:func:`in_step_with`; one whose step runs past its rounds only
    with the others' support, :func:`plausible_lead`) that is furthest ahead (at its
    :func:`projected_step`, DHT time ``now``). We move up when we are at least ``min_lag_seconds`` behind it
    at our own ``step_seconds`` (a shorter lag is covered by the lead's patience), or a whole ``H`` steps
    behind (also while our step time is not measured yet). The new step is just before the latest sync step
    the lead has reached, so that sync is our next launch: never past it (we would skip the round the lead
    is looking for a group for), never back.
    """
    candidates = [(projected_step(rec, now=now, step_seconds=step_seconds, H=H, num_fragments=num_fragments),
                   rec.peer_id, rec) for pid, rec in records.items() if pid != me and in_step_with(rec, my_rounds)]
    if not candidates:
        return None
    # A lead whose step runs past its rounds needs support: at most H past the lower median of the candidates
    # (one forged record among honest ones cannot pull the swarm), unless it is the only one to follow.
    ordered = sorted(c[0] for c in candidates)
    median = ordered[(len(ordered) - 1) // 2]
    leads = [(s, pid) for s, pid, rec in candidates
             if len(candidates) == 1 or plausible_lead(rec, H, num_fragments) or s <= median + H]
    if not leads:
        return None
    lead_step, lead = max(leads)
    behind = lead_step - my_step
    target = last_sync_step(lead_step, num_fragments, H) - 1
    far = behind >= H or (step_seconds is not None and behind * step_seconds >= min_lag_seconds)
    if target <= my_step or not far:
        return None
    return Realignment(step=target, lead=lead, behind_steps=behind)


# ---- the swarm's state: catching up and launching ---------------------------------------------------------
@dataclass(frozen=True)
class CatchUp:
    """Fragment ``fragment`` should be replaced by the majority's state ``(round, digest)`` held by ``donors``.
    ``wait``: not yet. Our state is off, but the records of the state's holders still show a round before ours
    (records lag by up to a heartbeat); the caller checks again soon and downloads once they show where the
    holders are now."""

    fragment: int
    round: int
    digest: str
    donors: list[str]
    reason: str
    wait: bool = False


def _others(records: Mapping[str, ProgressRecord], me: str, fragment: int) -> list[tuple[str, int, str]]:
    """(peer id, applied round, digest) of ``fragment`` for every other peer that advertises it."""
    return [(rec.peer_id, rec.rounds[fragment], rec.digests[fragment]) for rec in records.values()
            if rec.peer_id != me and len(rec.rounds) > fragment and len(rec.digests) > fragment]


def digest_at(rec: ProgressRecord, fragment: int, round_: int) -> Optional[str]:
    """``rec``'s digest of ``fragment`` after round ``round_``: its current one, or one it still lists in ``past``
    (rounds may come faster than records: a peer already a round past ours still tells where it was); None
    if the record does not say."""
    if len(rec.rounds) > fragment and len(rec.digests) > fragment and rec.rounds[fragment] == round_:
        return rec.digests[fragment]
    return next((d for f, r, d in rec.past if f == fragment and r == round_), None)


def _holders(records: Mapping[str, ProgressRecord], me: str, fragment: int,
             mine: Optional[tuple[int, str]]) -> dict[tuple[int, str], list[str]]:
    """{(applied round, digest) of ``fragment``: the peers of ``records`` that hold it}, ``me`` holding ``mine``."""
    holders: dict[tuple[int, str], list[str]] = {}
    for pid, r, d in _others(records, me, fragment):
        holders.setdefault((r, d), []).append(pid)
    if mine is not None:
        holders.setdefault(mine, []).append(me)
    return holders


def swarm_state(records: Mapping[str, ProgressRecord], me: str, fragment: int,
                mine: Optional[tuple[int, str]] = None, *, support: Optional[Mapping[str, ProgressRecord]] = None
                ) -> Optional[tuple[int, str, list[str]]]:
    """The swarm's state of ``fragment``: the (applied round, digest) held by the most peers of ``records`` (ties:
    the one more ``support`` records hold, then the later round, then the smaller digest), with the other holders
    that can serve it; None if no other peer advertises one. A peer in client mode counts as a holder but is no
    donor: nobody can dial it (behind a NAT).

    ``mine``: our own (applied round, digest), one holder like any other (every peer that reads the same records
    then counts the same holders). A state claimed by one partner, however far ahead, does not outvote an honest
    partner that holds ours: a tie that went to the later round made one stranger who sat in our first group the
    swarm's state. (With ``tau = H`` our vote is the state before the round in flight, which has no digest yet.)

    ``support``: every live record (``records`` are the vouched ones: :meth:`peer.net.swarm.Swarm.vouched_peers`),
    the word on a tie. Before its first group a peer's votes are its own and those of the peers its daemon holds a
    connection with; an attacker that is the first such peer tied our initial state with a round far ahead while
    the honest records holding ours were live but not listed yet, or listed but advertising no state yet (peers
    still building their model), and the later round won. A live record that advertises no state of the fragment
    backs ours at a tie (it holds no other, and may come to hold ours). So a tie goes to the later round only when
    as many live records hold each state and none is undecided (a joiner of a two-peer swarm takes the other's).
    Made-up ids can only break a tie: hold a joiner of a two-peer swarm on its own state (as one connected peer of
    theirs already can) or hand it the later round (as without them)."""
    holders = _holders(records, me, fragment, mine)
    if not any(pid != me for held in holders.values() for pid in held):
        return None
    backers = {} if support is None else _holders(support, me, fragment, mine)
    if support is not None and mine is not None:
        undecided = [pid for pid, rec in support.items()
                     if pid != me and (len(rec.rounds) <= fragment or len(rec.digests) <= fragment)]
        backers[mine] = backers.get(mine, []) + undecided
    (best, digest), held = max(holders.items(), key=lambda kv: (len(kv[1]), len(backers.get(kv[0], ())), kv[0][0],
                                                                [-ord(c) for c in kv[0][1]]))
    return best, digest, servable(records, [pid for pid in held if pid != me])


def servable(records: Mapping[str, ProgressRecord], holders: Sequence[str]) -> list[str]:
    """The ``holders`` that can serve a state download: those not in client mode (nobody can dial those)."""
    dialable = {rec.peer_id for rec in records.values() if not rec.client_mode}
    return [pid for pid in holders if pid in dialable]


def launch_verdict(records: Mapping[str, ProgressRecord], me: str, *, fragment: int, round_: int,
                   expected_round: int, min_group_size: int,
                   vouched: Optional[Mapping[str, ProgressRecord]] = None,
                   mine: Optional[tuple[int, str]] = None) -> Optional[tuple[RoundStatus, str]]:
    """Whether round ``round_`` of ``fragment`` goes to the swarm: None, or why not, as the round's status and
    a reason. The one place that decides it, before anything is sent:

    - ``alone``: fewer live peers than ``min_group_size`` (us included): no group can form; the progress is
      kept for the next round;
    - ``behind``: :func:`launch_gate` (the swarm is past the round, or our state is two or more rounds behind):
      the caller downloads the swarm's state right away.

    ``expected_round`` is the last round our state will have applied once our rounds in flight land. ``records``
    are every live peer's; ``vouched`` (default: the same) those whose word on the swarm's state counts
    (:meth:`peer.net.swarm.Swarm.vouched_peers`); ``mine``: our state's (applied round, digest) (:func:`swarm_state`).
    """
    live = live_count(records, me)
    if live < min_group_size:
        return RoundStatus.ALONE, f"{live} live peer(s) < min_group_size {min_group_size}"
    why = launch_gate(records if vouched is None else vouched, me, fragment, round_, expected_round, mine=mine,
                      support=records)
    return (RoundStatus.BEHIND, why) if why else None


def launch_gate(records: Mapping[str, ProgressRecord], me: str, fragment: int, round_: int,
                my_expected: int, *, mine: Optional[tuple[int, str]] = None,
                support: Optional[Mapping[str, ProgressRecord]] = None) -> Optional[str]:
    """Why round ``round_`` of ``fragment`` must not be launched from our state (None: launch it).

    ``my_expected`` is the last round our state will have applied once our rounds in flight land.

    - *late*: the swarm already applied that round, so no one will come to it;
    - *behind*: the swarm applied two or more rounds our state never will (our round counter ran on alone
      during a network outage, say): our outer gradient is relative to a state the swarm left long ago.

    Both are repaired by downloading the swarm's state at once (``plan_catch_up`` with ``late``),
    instead of waiting ``matchmaking_timeout`` for a group that never forms. One round behind
    (we missed the last one) we still launch: we join the swarm's current round, and the drift check
    replaces our state, which then differs, with the swarm's a round later. Skipping instead would leave
    us behind again by the time the download is done, round after round.
    """
    late = swarm_is_past(records, me, fragment, round_, mine=mine, support=support)
    if late:
        return late
    state = swarm_state(records, me, fragment, mine, support=support)
    if state is not None and state[0] >= my_expected + 2:
        return f"behind: our state stops at round {my_expected}, the swarm applied {state[0]}"
    return None


def swarm_is_past(records: Mapping[str, ProgressRecord], me: str, fragment: int, round_: int, *,
                  mine: Optional[tuple[int, str]] = None,
                  support: Optional[Mapping[str, ProgressRecord]] = None) -> Optional[str]:
    """Why no group will form for round ``round_`` of ``fragment`` any more (the swarm's state already
    includes it: we are late), or None. ``mine``, ``support``: see :func:`swarm_state`."""
    state = swarm_state(records, me, fragment, mine, support=support)
    return f"late: the swarm already applied round {state[0]}" if state and state[0] >= round_ else None


def plan_catch_up(records: Mapping[str, ProgressRecord], me: str, my_rounds: Sequence[int],
                  my_digests: Sequence[str], *, joining: bool,
                  expected: Optional[Sequence[int]] = None, late: bool = False, suspect: Sequence[int] = (),
                  my_past: Sequence[Mapping[int, str]] = (),
                  confirmed: Sequence[Mapping[int, Collection[str]]] = (),
                  support: Optional[Mapping[str, ProgressRecord]] = None) -> list[CatchUp]:
    """Which fragments to download, from the other peers' progress records (pure; see below).

    Rounds here are *applied* rounds (a peer that trained alone does not advance). For each fragment, the swarm's
    state is :func:`swarm_state`, ours counted (a tie: what more ``support`` records hold). ``expected``: per
    fragment, the round our state reaches once our rounds in flight land (default: ``my_rounds``). We download
    the swarm's state when we are behind: ``joining``, by any round; ``late`` (a round was just found late, see
    :func:`launch_gate`), when the swarm is past ``expected``; otherwise by two or more, since a peer may see others a
    moment after they applied the round it is about to apply. Or when no other peer that applied our round (its current
    one or one in its ``past``: :func:`digest_at`) holds our digest there and theirs wins (we then download where its
    holders are now): it is held by two or more, or it is the smaller of a tie once no other peer's record is behind our
    round (two survivors of a broken round converge on one state; a record not yet updated cannot turn a tie against the
    majority), or any other digest for a fragment in ``suspect`` (our own last round of it was partial: we are the
    likely odd one out). Where the holders' records still show a round before ``expected``, that plan ``wait``s:
    adopting it would drop our rounds since, and the next round would apply the swarm's average to a state a round old,
    off again.

    ``my_past``: per fragment, our own digests of earlier rounds ({round: digest}). When rounds come faster than
    records, no other record has reached our current round yet; the comparison is then made at our latest
    earlier round that other records cover (a state that went off stays off: every later round applies the
    same averages to it).

    ``confirmed``: per fragment, {round: the other peers that applied that round of ours with us} (the group's
    appliers hold our digest there by construction: docs/architecture.md, "One digest for every applied round").
    At such a round only their records can tell us we are off; other records, however many (sybils that sat
    in one group and became partners), cannot.
    """
    plans = []
    for p, (mine_r, mine_d) in enumerate(zip(my_rounds, my_digests)):
        state = swarm_state(records, me, p, (mine_r, mine_d), support=support)
        if state is None:
            continue
        best, digest, donors = state
        others = _others(records, me, p)
        check_r, check_d, at_mine = _latest_covered(records, me, p, {**(my_past[p] if p < len(my_past) else {}),
                                                                     mine_r: mine_d})
        appliers = confirmed[p].get(check_r) if p < len(confirmed) else None
        if appliers is not None:
            at_mine = {pid: d for pid, d in at_mine.items() if pid in appliers}
        same_round = list(at_mine.values())
        ours = expected[p] if expected is not None else mine_r
        if best > mine_r and (joining or best >= mine_r + 2 or (late and best > ours)):
            plans.append(CatchUp(p, best, digest, donors, f"behind: round {mine_r}, swarm at {best}"))
        elif same_round and check_d not in same_round:
            # We disagree with everyone at our round. The most common digest there wins over ours when more
            # peers hold it than ours (us counted); a tie goes to the smallest, so two survivors of a broken
            # round converge on one state, but only once every other peer's record has reached our round:
            # records lag by up to a heartbeat, and a tie against the one peer whose record is already here
            # (say, after a partial round of its own) would pull us off the state the others are about to show.
            counts = {d: same_round.count(d) for d in same_round}
            winner = min(counts, key=lambda d: (-counts[d], d))
            # ``suspect``: fragments whose state we know to be off since a partial round of ours (a span we did
            # not apply): there any other digest at our round wins a tie. (Two suspects holding each other's
            # digest swap once; neither is suspect after adopting, so the next check converges them.)
            settled = all(r >= check_r for _, r, _ in others)
            if counts[winner] > 1 or p in suspect or (settled and winner < check_d):
                # Download what the winner's holders hold now: our round, or a later one they have applied since.
                newest: dict[tuple[int, str], list[str]] = {}
                for pid, r, d in others:
                    if at_mine.get(pid) == winner:
                        newest.setdefault((r, d), []).append(pid)
                (round_, digest), holders = max(newest.items(), key=lambda kv: (len(kv[1]), kv[0][0]))
                plans.append(CatchUp(p, round_, digest, servable(records, holders),
                                     f"digest {check_d[:12]} disagrees with the swarm's at round {check_r}",
                                     wait=round_ < ours))
    return plans


def plan_owed(records: Mapping[str, ProgressRecord], fragment: int, round_: int, appliers: Sequence[str],
              reason: str) -> CatchUp:
    """The download owed after an ``off_base`` round: our part went into round ``round_`` of ``fragment``, which
    ``appliers`` applied to a base other than ours. Their state is ours to take: the (round, digest) most of them
    hold now, at ``round_`` or later (ties: the later round). ``wait`` until one of their records shows it."""
    held: dict[tuple[int, str], list[str]] = {}
    for pid in appliers:
        rec = records.get(pid)
        if rec is not None and len(rec.rounds) > fragment and len(rec.digests) > fragment \
                and rec.rounds[fragment] >= round_:
            held.setdefault((rec.rounds[fragment], rec.digests[fragment]), []).append(pid)
    if not held:
        return CatchUp(fragment, round_, "", [], reason, wait=True)
    (best, digest), holders = max(held.items(), key=lambda kv: (len(kv[1]), kv[0][0]))
    return CatchUp(fragment, best, digest, servable(records, holders), reason)


def _latest_covered(records: Mapping[str, ProgressRecord], me: str, fragment: int,
                    history: Mapping[int, str]) -> tuple[int, str, dict[str, str]]:
    """Our latest round in ``history`` ({round: our digest}) at which other records tell their digest, with
    ours and theirs ({peer: digest}); our latest round and no digests if no record covers any."""
    for round_, mine in sorted(history.items(), reverse=True):
        theirs = {pid: d for pid, rec in records.items() if pid != me and (d := digest_at(rec, fragment, round_))}
        if theirs:
            return round_, mine, theirs
    latest = max(history)
    return latest, history[latest], {}


def plausible_donor_step(step: int, fragment: int, round_: int, num_fragments: int, H: int) -> int:
    """A snapshot's step as the steps schedule allows it (the donor says it; nothing else does): its donor applied
    round ``round_`` of ``fragment`` at most ``H`` steps after that round's sync step. A larger claim would move us
    far ahead (a hostile donor's step 10^9 ended a peer's run at once)."""
    return max(0, min(step, sync_step(fragment, round_, num_fragments, H) + H))


def step_after_catch_up(step: int, donor_steps: Sequence[int], records: Mapping[str, ProgressRecord], me: str,
                        H: int) -> int:
    """The step to continue from after downloading fragments from donors whose snapshots were taken at
    ``donor_steps`` (steps schedule): the next round we launch must be the swarm's next round, never one we
    just downloaded.

    Behind the donors' step: move up to it. Back only if we ran ahead of everyone alone (our round counter kept
    running during an outage: more than ``H`` past every other peer's step); moving back otherwise would
    re-launch rounds of the other fragments that we have already applied. (:func:`realign` then moves us up to
    the swarm's current step: a snapshot's step is when its donor applied the round.)
    """
    if not donor_steps:
        return step
    swarm_step = max((rec.step for pid, rec in records.items() if pid != me), default=step)
    if step < max(donor_steps) or step > swarm_step + H:
        return max(donor_steps)
    return step
