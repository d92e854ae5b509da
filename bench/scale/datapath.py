"""The bounded design's data path on small tensors, through the real codecs (``peer.outer.codec``): what every peer
ends with. Level 1 parts go in the run's codec, partial sums up the levels in fp8, and each top holder encodes its
sub-slot's weighted mean once; those bytes go down unchanged. Used by tests/test_scale_sim.py to check that every
peer holds the same bytes for every sub-slot, that they decode to the weighted mean within the codec's error, and
that no peer has more than ``cap - 1`` partners in any level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from peer.outer.codec import get_codec

from .bounded import Group, build_tree, seat

ALIGN = 64


def cut(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) in ``parts`` ranges of whole 64-element blocks (the last ones may be empty)."""
    blocks = math.ceil((end - start) / ALIGN)
    bounds = [min(end, start + (blocks * k // parts) * ALIGN) for k in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class PathResult:
    leaves: dict[tuple[int, int], dict[int, bytes]]  # (start, end) -> {peer: the bytes it holds}
    expected: torch.Tensor  # the weighted mean of the live peers' vectors
    partners_per_level: dict[int, int] = field(default_factory=dict)  # level -> most partners of one peer
    groups: list[Group] = field(default_factory=list)


def run(vectors: list[torch.Tensor], weights: list[float], cap: int, clients: frozenset = frozenset(),
        dead: frozenset = frozenset(), codec: str = "e3m0") -> PathResult:
    """Peers 0..N-1 in level-1 groups of at most ``cap`` (clients spread evenly); ``dead`` peers send nothing and
    forward nothing (they died before the round's first message)."""
    n_peers, n = len(vectors), vectors[0].numel()
    wire, partial_codec = get_codec(codec), get_codec("fp8")
    count = math.ceil(n_peers / cap)
    open_seats = [p for p in range(n_peers) if p not in clients]
    client_seats = [p for p in range(n_peers) if p in clients]
    first = seat(open_seats, client_seats, count)
    groups = build_tree(first, [[p for p in m if p not in clients] for m in first], float(n), cap)
    ranges: dict[int, tuple[int, int]] = {}
    sums: dict[tuple[int, int], tuple[torch.Tensor, float]] = {}  # (group, slot) -> (weighted sum, weight)
    for gi, g in enumerate(groups):  # children first
        if g.level == 1:
            ranges[gi] = (0, n)
        else:
            ranges[gi] = cut(*ranges[g.children[0]], groups[g.children[0]].slots)[g.child_slot]
        for s, (a, b) in enumerate(cut(*ranges[gi], g.slots)):
            total, weight = torch.zeros(b - a), 0.0
            for k, p in enumerate(g.members):
                if p in dead or g.members[g.holders[s]] in dead:
                    continue
                if g.level == 1:
                    value, w = wire.decode_flat(wire.encode_flat(vectors[p][a:b])) * weights[p], weights[p]
                else:
                    child_sum, w = sums[g.children[k], g.child_slot]
                    value = partial_codec.decode_flat(partial_codec.encode_flat(child_sum[a - ranges[gi][0]:][:b - a]))
                    if not w:
                        continue
                total, weight = total + value, weight + w
            sums[gi, s] = (total, weight)
    top = max(g.level for g in groups)
    leaves: dict[tuple[int, int], dict[int, bytes]] = {}
    for gi in reversed(range(len(groups))):  # top first: results go down unchanged
        g = groups[gi]
        for s, (a, b) in enumerate(cut(*ranges[gi], g.slots)):
            holder = g.members[g.holders[s]]
            if g.level == top:
                total, weight = sums[gi, s]
                if holder in dead or weight == 0 or b == a:
                    continue
                blob = wire.encode_flat(total / weight).SerializeToString()
                leaves[a, b] = {}
                for p in g.members:
                    if p not in dead:
                        _deliver(groups, gi, p, (a, b), blob, leaves)
    expected = sum(w * v for w, v, p in zip(weights, vectors, range(n_peers)) if p not in dead)
    live_weight = sum(w for p, w in enumerate(weights) if p not in dead)
    partners: dict[tuple[int, int], set] = {}
    for g in groups:
        for p in g.members:
            partners.setdefault((g.level, p), set()).update(q for q in g.members if q != p)
    per_level: dict[int, int] = {}
    for (level, _p), ps in partners.items():
        per_level[level] = max(per_level.get(level, 0), len(ps))
    return PathResult(leaves, expected / live_weight, per_level, groups)


def _deliver(groups: list[Group], ci: int, peer: int, leaf: tuple[int, int], blob: bytes,
             leaves: dict[tuple[int, int], dict[int, bytes]]) -> None:
    """``peer``, a member of group ``ci``, got ``blob``: at level 1 it keeps it; above, it forwards it unchanged to
    every member of the group below whose range it holds, and they do the same."""
    g = groups[ci]
    if g.level == 1:
        leaves[leaf][peer] = blob
        return
    child_index = g.children[g.members.index(peer)]
    for q in groups[child_index].members:
        _deliver(groups, child_index, q, leaf, blob, leaves)
