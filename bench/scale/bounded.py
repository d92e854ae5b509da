"""The proposed design beyond one group: a multi-level butterfly with a group cap (docs/architecture.md, "Beyond
one group"), as flows.

Level 1: peers meet in groups of at most ``cap`` (matchmaking with group bits: a read returns ~cap entries, and a
group forms when full, or at ``cutoff`` after the slot's start with whoever joined). Each group cuts the fragment
into ``cap`` slots (the same cut in every group) held round-robin by its non-client members, and reduce-scatters:
member i sends slot s to its holder. The leaders publish their rosters; at ``cutoff`` every peer reads them, and
the plan of the upper levels follows from the roster alone (groups in roster order), so every peer derives the
same plan. Level l+1: for each slot, the holders of that slot across ``f`` level-l groups (f = the fan-in that
reaches one group per slot in the fewest levels, <= cap) form a group, cut the slot into ``f`` sub-slots held
round-robin, and reduce-scatter their partial sums (fp8 on the wire: an intermediate value, never applied). When
a level has one group per range, its holders are the top: each encodes its sub-slot's result once (the run's
codec), and the bytes go back down unchanged: a holder that has every sub-slot of its range forwards the range's
bytes to its group below, down to every peer. A node that dies loses, for its round: as a member, its part; as
a holder, its range's partial (its subtree's contribution) and the forwarding of that range to its group below;
as a top holder, its sub-slot for every peer. Deadlines: ``part_timeout`` per level on the way up (from the
level below's), ``allreduce_timeout`` after the last level's on the way down. Not simulated: a member that fetches a
range a dead forwarder did not send from another holder of it (the design allows it; the bytes are the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .calibration import Workload
from .flows import FlowSet, solve
from .links import Links
from .matching import RoundOutcome, dht_hops, empty_outcome, launches, ready_to_join


@dataclass
class Group:
    level: int
    members: list[int]  # global peer ids
    size: float  # elements of the range it reduces
    slots: int
    holders: list[int]  # per slot: index into members
    children: list[int] = field(default_factory=list)  # per member: the level-below group it holds the range of
    child_slot: int = -1  # which slot of each child's range this group reduces
    parents: list[int] = field(default_factory=list)  # per slot: the group above that reduces it (-1: top)
    reduce_gate: list[int] = field(default_factory=list)
    result_gate: list[int] = field(default_factory=list)  # per slot: the holder has the slot's final bytes
    deadline: float = 0.0


def plan_levels(groups: int, cap: int) -> tuple[int, int]:
    """(levels above the first, fan-in) that bring ``groups`` first-level groups to one per range."""
    if groups <= 1:
        return 0, 1
    levels = math.ceil(math.log(groups) / math.log(cap) - 1e-9)
    return levels, math.ceil(groups ** (1 / levels) - 1e-9)


def chunks(items: list, count: int) -> list[list]:
    """``items`` in ``count`` consecutive chunks of near-equal size."""
    bounds = np.linspace(0, len(items), count + 1).round().astype(int)
    return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def seat(open_seats: list, client_seats: list, count: int) -> list[list]:
    """``count`` groups of near-equal size, each with its near-equal share of the client-mode peers."""
    sizes = [len(c) for c in chunks(list(range(len(open_seats) + len(client_seats))), count)]
    clients = [len(c) for c in chunks(client_seats, count)]
    groups, taken_open, taken_client = [], 0, 0
    for size, k in zip(sizes, clients):
        k = min(k, size - 1) if size > 1 else k
        opened = size - k
        groups.append(open_seats[taken_open:taken_open + opened] + client_seats[taken_client:taken_client + k])
        taken_open, taken_client = taken_open + opened, taken_client + k
    return groups


def build_tree(first: list[list[int]], reducers: list[list[int]], n: float, cap: int) -> list[Group]:
    """All groups of one round: ``first`` the level-1 groups' members, ``reducers`` their non-client members (each
    group must have one). Level 1 cuts the fragment into as many slots as the group with the fewest reducers has
    (at most ``cap``), and each level above cuts its range into as many sub-slots as its smallest group has members,
    so every holder holds one slot and every peer is in at most one group per level (<= cap - 1 partners)."""
    slots = min(cap, min(len(r) for r in reducers))
    groups = [Group(1, m, n, slots, [m.index(r[s]) for s in range(slots)]) for m, r in zip(first, reducers)]
    levels, fan_in = plan_levels(len(groups), cap)
    families = [list(range(len(groups)))]
    for _ in range(levels):
        k = len(families[0])
        parts = chunks(families[0], math.ceil(k / fan_in))
        sub_slots = min(len(part) for part in parts)
        next_families = []
        for fam in families:
            head = groups[fam[0]]
            for s in range(head.slots):
                new_family = []
                for part in chunks(fam, math.ceil(k / fan_in)):
                    members = [groups[c].members[groups[c].holders[s]] for c in part]
                    groups.append(Group(head.level + 1, members, head.size / head.slots, sub_slots,
                                        list(range(sub_slots)), children=list(part), child_slot=s))
                    new_family.append(len(groups) - 1)
                next_families.append(new_family)
        families = next_families
    for g in groups:
        g.parents = [-1] * g.slots
    for gi, g in enumerate(groups):
        for c in g.children:
            groups[c].parents[g.child_slot] = gi
    return groups


def bounded_round(t0: float, peers: np.ndarray, live: int, death: np.ndarray, client: np.ndarray, links: Links,
                  wl: Workload, rng: np.random.Generator, *, cap: int = 8, cutoff: float = 5.0) -> RoundOutcome:
    to, costs = wl.timeouts, wl.costs
    launch = launches(peers, t0, wl, rng)
    ready = ready_to_join(peers, launch, links, entries=cap, n_swarm=len(links), wl=wl, rng=rng)
    ok = (death[peers] > ready) & (ready <= t0 + cutoff)
    order = [int(i) for i in np.argsort(ready, kind="stable") if ok[i]]
    # the target size balances the live count over groups of at most cap (as today's target is the live count),
    # and a group keeps seats for non-client members in the swarm's proportion (records say who is a client)
    count = math.ceil(live / cap)
    target = math.ceil(live / count)
    open_seats = [i for i in order if not client[peers[i]]]
    client_seats = [i for i in order if client[peers[i]]]
    groups_now = max(1, math.ceil(len(order) / target))
    first = [sorted(grp, key=lambda i: ready[i]) for grp in seat(open_seats, client_seats, groups_now)]
    formed = [float(ready[grp[-1]]) if len(grp) == target else t0 + cutoff for grp in first]
    keep = [k for k, grp in enumerate(first) if len(grp) >= 2 and not client[peers[grp]].all()]
    first, formed = [first[k] for k in keep], [formed[k] for k in keep]
    if not first:
        return empty_outcome(peers, launch, death, np.full(peers.size, t0 + cutoff), "no_group")
    # the plan is read at the cutoff, or once the rosters hold every live peer
    everyone = len(order) >= live
    plan_at = min(t0 + cutoff, max(formed)) if everyone else t0 + cutoff
    local = {int(p): i for i, p in enumerate(peers)}
    start = np.full(peers.size, np.nan)
    for grp, t_form in zip(first, formed):
        leader = peers[grp[0]]
        start[grp] = t_form + costs.round_overhead_s + links.one_way(np.full(len(grp), leader), peers[grp])
    rtt_med = float(np.median(links.rtt(peers, np.roll(peers, 1))))
    roster = len(peers) * wl.member_info_bytes / (costs.link_efficiency * float(np.median(links.down)))
    plan_time = plan_at + dht_hops(len(links)) * rtt_med + roster
    members = [[int(peers[i]) for i in grp] for grp in first]
    reducers = [[p for p in m if not client[p]] for m in members]
    n = wl.fragment_elems
    groups = build_tree(members, reducers, n, cap)
    top_level = max(g.level for g in groups)
    flows = FlowSet()
    rows: list[tuple] = []  # src, dst, bytes, start, wait, feed, deadline

    def peer_start(p: int) -> float:
        return float(start[local[p]])

    for g in groups:  # reduction gates, bottom-up (children before parents: construction order)
        piece = g.size / g.slots
        top = g.level == top_level
        out_codec = wl.codec if top else "fp8"
        delay = costs.combine_s(piece * len(g.members)) + costs.encode_s(piece, out_codec)
        if g.level == 1:
            g.deadline = max(peer_start(p) for p in g.members) + to.part_timeout
            floor = [peer_start(g.members[h]) + costs.encode_s(piece) for h in g.holders]
            if top_level > 1:
                floor = [max(f, plan_time - delay) for f in floor]
        else:
            g.deadline = max(groups[c].deadline for c in g.children) + to.part_timeout
            floor = [plan_time] * g.slots
        g.reduce_gate = [flows.gate(g.deadline, not_before=floor[s], delay=delay, on_end=True) for s in range(g.slots)]
    down_deadline = max(g.deadline for g in groups) + to.allreduce_timeout - to.part_timeout
    for g in groups:
        g.result_gate = list(g.reduce_gate) if g.level == top_level else \
            [flows.gate(down_deadline, on_end=True) for _ in range(g.slots)]
    for g in groups:
        piece = g.size / g.slots
        for s, h in enumerate(g.holders):
            holder = g.members[h]
            for a, p in enumerate(g.members):
                if g.level == 1:  # parts up, results down
                    if p != holder:
                        rows.append((p, holder, wl.wire_bytes(piece), peer_start(p) + costs.encode_s(n), -1,
                                     g.reduce_gate[s], g.deadline))
                        rows.append((holder, p, wl.wire_bytes(piece), np.inf, g.result_gate[s], -1, down_deadline))
                    continue
                child = groups[g.children[a]]
                partial_ready = child.reduce_gate[g.child_slot]
                rows.append((p, holder, 0.0 if p == holder else wl.wire_bytes(piece, "fp8"), np.inf, partial_ready,
                             g.reduce_gate[s], g.deadline))
                rows.append((holder, p, 0.0 if p == holder else wl.wire_bytes(piece), np.inf, g.result_gate[s],
                             child.result_gate[g.child_slot], down_deadline))
    cols = list(zip(*rows))
    ids = flows.add(np.array(cols[0]), np.array(cols[1]), np.array(cols[2]), start=np.array(cols[3]),
                    wait=np.array(cols[4]), feed=np.array(cols[5]), deadline=np.array(cols[6]))
    res = solve(flows, links.up, links.down, death, links.one_way, efficiency=costs.link_efficiency)
    return _outcome(peers, launch, death, start, groups, rows, ids, res, flows, wl, top_level, t0 + cutoff)


def _outcome(peers, launch, death, start, groups, rows, ids, res, flows, wl, top_level, late) -> RoundOutcome:
    """Per peer: the share of the fragment that reached it, when, bytes and streams."""
    gate_ready = res.gate_open + np.asarray(flows.gate_delay)
    done = {}
    for (src, dst, _size, _start, wait, feed, _dl), i in zip(rows, ids):
        done[(src, dst, wait, feed)] = (bool(res.completed[i]), float(res.finish[i]))
    avail: dict[tuple[int, int], float] = {}
    for gi in reversed(range(len(groups))):  # parents were built after their children: top first
        g = groups[gi]
        for s, h in enumerate(g.holders):
            holder = g.members[h]
            if g.level == top_level:
                avail[gi, s] = float(death[holder] > gate_ready[g.reduce_gate[s]])
                continue
            up = groups[g.parents[s]]
            pg = g.parents[s]
            got = 0.0
            for s2, h2 in enumerate(up.holders):
                src = up.members[h2]
                ok = src == holder or done.get((src, holder, up.result_gate[s2], g.result_gate[s]), (False, 0))[0]
                got += avail[pg, s2] / up.slots if ok else 0.0
            avail[gi, s] = got
    local = {int(p): i for i, p in enumerate(peers)}
    out = empty_outcome(peers, launch, death, np.full(peers.size, late), "ok")
    sent = np.bincount(np.asarray([r[0] for r in rows]), weights=res.moved[ids], minlength=death.size)
    recv = np.bincount(np.asarray([r[1] for r in rows]), weights=res.moved[ids], minlength=death.size)
    partners: dict[int, set] = {}
    for r in rows:
        if r[0] != r[1]:
            partners.setdefault(r[0], set()).add(r[1])
            partners.setdefault(r[1], set()).add(r[0])
    for gi, g in enumerate(groups):
        if g.level != 1:
            continue
        for p in g.members:
            i = local[p]
            end, got = float(start[i]), 0.0
            for s, h in enumerate(g.holders):
                holder = g.members[h]
                if holder == p:
                    ok, t = death[p] > gate_ready[g.result_gate[s]], float(gate_ready[g.result_gate[s]])
                else:
                    ok, t = done[(holder, p, g.result_gate[s], -1)]
                got += avail[gi, s] / g.slots if ok else 0.0
                end = max(end, t)
            out.in_group[i] = True
            out.matchmaking_s[i] = start[i] - launch[i]
            out.end[i] = end + wl.costs.decode_s(wl.fragment_elems)
            out.applied[i] = got
    out.sent[:] = sent[peers]
    out.received[:] = recv[peers]
    out.remote_peers[:] = [len(partners.get(int(p), ())) for p in peers]
    out.streams[:] = out.remote_peers
    out.died = death[peers] < out.end
    out.levels = top_level
    out.flow_steps = res.steps
    out.extra["groups"] = len(groups)
    out.extra["max_group"] = max(len(g.members) for g in groups)
    out.extra["per_level_partners"] = _partners_per_level(groups)
    return out


def _partners_per_level(groups: list[Group]) -> int:
    """The most distinct partners any peer has within one level (<= cap - 1 by construction)."""
    most = 0
    per: dict[tuple[int, int], set] = {}
    for g in groups:
        for p in g.members:
            per.setdefault((g.level, p), set()).update(q for q in g.members if q != p)
    for partners in per.values():
        most = max(most, len(partners))
    return most
