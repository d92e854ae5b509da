"""Today's protocol: one butterfly group per fragment round (peer/net/round/matchmaking.py,
peer/net/round/allreduce.py).

Matchmaking: the target group size is every live peer (transport.py: ``1 + live records``), so the group forms at
once only when every peer whose record is live joined; otherwise the leader (the first to declare) assembles it at
its expiration, ``matchmaking_time`` after its declaration, with whoever joined (>= min_group_size 2). A record
stays live for ``progress_ttl`` after a crash, and a restarted peer's record is live while it downloads the state,
so each of them costs every round they overlap ``matchmaking_time``. The leader then sends every member the group
(M peer ids and MemberInfos) from its uplink. A group of more than 256 (group.py MAX_GROUP_SIZE) is a GroupError on
every member; ``ideal=True`` lifts that cap and the stream cap, to show the costs behind them.

All-reduce: the fragment is cut into one span per non-client member. Each member encodes its part once and streams
part j to reducer j (one stream per reducer, which carries the average back); reducer j waits for every member's
part or ``part_timeout`` after the group formed, combines (the clipped rule), encodes once and streams the average
to every member, which waits at most ``allreduce_timeout``. A reducer that crashes loses its span for every member
(a member sees the reset at once); a member that crashes loses its part, and every reducer stops waiting for it
once its stream ends (a reset is seen at once: ``SpanReduction.give_up_on``). Design ``flat-waits`` is the reducer
of before that fix, which waited ``part_timeout`` for the count of parts.
"""

from __future__ import annotations

import numpy as np

from .calibration import Workload
from .flows import FlowSet, solve
from .links import Links
from .matching import RoundOutcome, empty_outcome, launches, ready_to_join


def flat_round(t0: float, peers: np.ndarray, live: int, death: np.ndarray, client: np.ndarray, links: Links,
               wl: Workload, rng: np.random.Generator, *, ideal: bool = False,
               waits_for_dead: bool = False) -> RoundOutcome:
    """Simulates one round slot starting at ``t0`` for the training ``peers``. ``waits_for_dead``: the reducer of
    before the crash-phase fix, which waited ``part_timeout`` for a member whose stream had ended."""
    to = wl.timeouts
    launch = launches(peers, t0, wl, rng)
    ready = ready_to_join(peers, launch, links, entries=peers.size, n_swarm=len(links), wl=wl, rng=rng)
    leader_at = int(np.argmin(launch))
    expiration = launch[leader_at] + (ready[leader_at] - launch[leader_at]) + to.matchmaking_time
    alive_at_ready = death[peers] > ready
    everyone = peers.size >= live and bool(alive_at_ready.all())
    formed = float(ready.max()) if everyone else expiration
    joined = alive_at_ready & (ready <= formed)
    members = peers[joined]
    m = members.size
    if m < 2:  # alone: no group within matchmaking_timeout
        return empty_outcome(peers, launch, death, launch + to.matchmaking_timeout, "no_group")
    leader = members[np.argmin(launch[joined])]
    group_msg = m * (m - 1) * wl.member_info_bytes / (wl.costs.link_efficiency * links.up[leader])
    start = formed + wl.costs.round_overhead_s + group_msg * rng.random(m) + links.one_way(np.full(m, leader), members)
    if not ideal and m > to.max_group_size:  # GroupError on every member: the round is skipped at once
        end = np.where(joined, 0.0, launch + to.matchmaking_timeout)
        end[joined] = start
        out = empty_outcome(peers, launch, death, end, "group_error", np.nan)
        out.matchmaking_s[joined] = start - launch[joined]
        out.extra["group_size"] = m
        return out
    reducers = np.flatnonzero(~client[members])
    if reducers.size == 0:
        return empty_outcome(peers, launch, death, start.max() + 0 * launch, "group_error")
    n = wl.fragment_elems
    span = n / reducers.size
    span_bytes = wl.wire_bytes(span)
    costs = wl.costs
    flows = FlowSet()
    gates = [flows.gate(start[j] + to.part_timeout, not_before=start[j] + costs.encode_s(span),
                        delay=costs.combine_s(span * m) + costs.encode_s(span), on_end=not waits_for_dead)
             for j in reducers]
    # parts: member i -> reducer j (i != j), after encoding its whole part
    mi, rj = np.meshgrid(np.arange(m), np.arange(reducers.size), indexing="ij")
    mi, rj = mi.ravel(), rj.ravel()
    keep = mi != reducers[rj]
    mi, rj = mi[keep], rj[keep]
    gate_ids = np.asarray(gates)[rj]
    gate_deadline = start[reducers[rj]] + to.part_timeout
    parts = flows.add(members[mi], members[reducers[rj]], span_bytes, start=start[mi] + costs.encode_s(n),
                      feed=gate_ids, deadline=gate_deadline)
    averages = flows.add(members[reducers[rj]], members[mi], span_bytes, wait=gate_ids,
                         deadline=start[mi] + to.allreduce_timeout)
    res = solve(flows, links.up, links.down, death, links.one_way, efficiency=costs.link_efficiency)
    # per member: spans in, and when its round ends
    got = np.zeros(m)
    end = start.copy()
    own_ready = res.gate_open + np.asarray(flows.gate_delay)
    for k, j in enumerate(reducers):  # a reducer's own span: local, once its gate opened (if it lives)
        if death[members[j]] > own_ready[k]:
            got[j] += 1
            end[j] = max(end[j], own_ready[k])
    done = res.completed[averages]
    np.add.at(got, mi[done], 1)
    # a member knows its span's fate when the average is in, or its stream was cut (reset or deadline)
    arrival = np.maximum(res.finish[averages], start[mi])
    np.maximum.at(end, mi, arrival)
    # a reducer returns only once its average reached every member still reading (the same ends)
    np.maximum.at(end, reducers[rj], arrival)
    end += costs.decode_s(n)
    sent = np.bincount(np.r_[mi, reducers[rj]], weights=np.r_[res.moved[parts], res.moved[averages]], minlength=m)
    recv = np.bincount(np.r_[reducers[rj], mi], weights=np.r_[res.moved[parts], res.moved[averages]], minlength=m)
    is_reducer = np.zeros(m, bool)
    is_reducer[reducers] = True
    streams = (reducers.size - is_reducer) + np.where(is_reducer, m - 1, 0)
    out = empty_outcome(peers, launch, death, launch + to.matchmaking_timeout, "ok")
    idx = np.flatnonzero(joined)
    out.in_group[idx] = True
    out.matchmaking_s[idx] = start - launch[joined]
    out.end[idx] = end
    out.applied[idx] = got / reducers.size
    out.sent[idx], out.received[idx] = sent, recv
    out.streams[idx] = streams
    out.remote_peers[idx] = m - 1
    out.died = death[peers] < out.end
    out.flow_steps = res.steps
    out.extra["group_size"] = m
    return out
