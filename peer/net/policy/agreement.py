"""Which members of an assembled group apply its average (pure: no I/O, no torch).

Invariant: every peer that applies round r of fragment f holds the same digest (of ``G, v``) after it. The update is
deterministic and every member decodes the same bytes (checked: trust/span_proofs.py), so it holds when (1) all
appliers start from one base, (2) each applies the whole average (only ``ok`` rounds), and (3) only one group of
the round applies. From the members' ``MemberInfo`` (:func:`agree`, one :class:`GroupVerdict`) and our own count:

- the group's base is the one most members declared (ties: the later round, then the smaller digest); a member
  with another base contributes but applies nothing, and downloads the result (``off_base``);
- a one-level group applies only with more than half of the upper median of its members' declared counts
  (:func:`quorum_peers`), and for each member only if it also holds more than half of that member's own count
  (:func:`our_count_holds`: what others declare cannot make a group a majority for it); so at most one group of a
  round applies (``minority`` otherwise). In two levels, per slot at level 2 (:func:`slot_verdict`).

Proof sketch and the split swarm: docs/architecture.md, "One digest for every applied round".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Sequence

from peer.proto import allreduce_pb2 as pb

DIGEST_CHARS = 64  # at most, hex (a BLAKE3-128 digest is 32)


@dataclass(frozen=True)
class GroupVerdict:
    """What every member of one group concludes from the same infos."""

    base: str  # the group's base digest
    base_round: int
    appliers: tuple[int, ...]  # member indices (group order) whose base is the group's
    quorum: bool  # the group may apply its average
    expected: int  # the quorum's denominator (the upper median of the declared counts)
    counted: int  # the quorum's numerator: the peers the members count for (one each in one level)


def valid_base(info: pb.MemberInfo) -> bool:
    """A declared base the protocol accepts: a lowercase hex digest of at most DIGEST_CHARS characters."""
    return 0 < len(info.base) <= DIGEST_CHARS and all(c in "0123456789abcdef" for c in info.base)


def agree(infos: Sequence[pb.MemberInfo], *, two_level: bool, sizes: Sequence[int] = ()) -> GroupVerdict:
    """The group's verdict from its members' infos (checked by :meth:`peer.net.round.group.GroupPlan.from_group`).
    ``two_level``: the group is level 1 of a two-level round (its quorum is judged per slot, :func:`slot_verdict`);
    ``sizes``: per member, how many peers it counts for (default 1 each)."""
    sizes = sizes or [1] * len(infos)
    holders: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        holders.setdefault(info.base, []).append(i)
    # the round of a base: the smallest any holder declared (a member cannot lift a base by claiming a later one)
    rounds = {base: min(infos[i].base_round for i in held) for base, held in holders.items()}
    held_by = {base: sum(sizes[i] for i in held) for base, held in holders.items()}
    base = min(holders, key=lambda b: (-held_by[b], -rounds[b], b))
    declared = sorted(max(1, info.expected) for info in infos)
    expected = declared[len(declared) // 2]
    quorum = two_level or 2 * sum(sizes) > expected
    return GroupVerdict(base, rounds[base], tuple(holders[base]), quorum, expected, sum(sizes))


def slot_verdict(infos: Sequence[pb.MemberInfo], cap: int) -> GroupVerdict:
    """The verdict of one slot's level-2 group (its members: the slot's holders in the level-1 groups that met,
    each declaring its group's base, ``expected`` and size ``members``). Each member counts for its group's peers,
    at most ``cap`` (a full group); the quorum is more than half of the upper median of the declared counts, as in
    one level: two level-2 groups of a slot are disjoint in peers, so at most one applies. A level-1 group that
    met no other applies alone only if it holds that majority itself. Members whose base is not the level-2
    group's reduce and send their parts but apply nothing. A hostile holder can claim a full group for a smaller
    one: two level-2 groups may then both apply, and the smaller side is off base at its next round."""
    return agree(infos, two_level=False, sizes=[min(max(1, info.members), cap) for info in infos])


def quorum_peers(expected: Collection[str], live: Iterable[str], partnered: Callable[[str], bool], me: str, *,
                 anchored: Collection[str] = ()) -> frozenset[str]:
    """The peers a member counts, whose number it declares (``MemberInfo.expected``): the peers its round waits for,
    every live peer it was in a group with, waited for or not, the live peers its daemon answers for (``anchored``:
    one per host), and itself. A partner that stays live but stopped coming (the other side of a partition, whose
    records still reach us) keeps counting, so the smaller side of a split never holds a majority however long the
    split lasts; so does a real peer we never met, so that a peer kept away from the others from its first round (a
    hostile leader's groups) does not come to count only itself and its captor. A partner that crashed stops counting
    when its record expires, so survivors go on; made-up ids (records no daemon answers for) count only while the
    round waits for them."""
    return frozenset(expected) | frozenset(partners(live, partnered)) | frozenset(anchored) | {me}


def our_count_holds(ids: Sequence[str], infos: Sequence[pb.MemberInfo], base: str, counted: Collection[str]) -> bool:
    """Whether a group (members ``ids`` with their ``infos``, of base ``base`` by :func:`agree`) is ours to apply by
    our own count ``counted`` (:func:`quorum_peers`, the set whose size we declared): its members include more than
    half of ``counted``, and of those members most declared ``base`` (:func:`agree`'s rule). A member applies a
    one-level round only if this holds as well as the group's verdict, which reads what every member declares and so
    what a hostile one writes: made-up ids count one each there, their low counts pull the median down and their
    bases outvote ours. With ``counted`` our own, two groups of a round each holding an applier of ours need a member
    of ``counted`` in both (an id we count, sent by its owner to two groups): ids we do not count, however many,
    never make a group ours nor choose its base (docs/architecture.md, "One digest for every applied round")."""
    counted = frozenset(counted)
    mine = [info for pid, info in zip(ids, infos) if pid in counted]
    return 2 * len(mine) > len(counted) and agree(mine, two_level=False).base == base


def partners(live: Iterable[str], partnered: Callable[[str], bool]) -> list[str]:
    """The peers of ``live`` we were in a group with (``partnered``: ``Roster.partnered``), in ``live``'s order: the
    ones whose records the consensus rules trust and who keep counting in a quorum."""
    return [p for p in live if partnered(p)]


def quorum_size(count: int, min_group_size: int) -> int:
    """The fewest members a one-level group of a member that declares ``count`` needs to apply its round (more
    than half of it), and at least ``min_group_size``. A leader assembles no smaller group: it would be a
    ``minority`` that applies nothing, and its members would go on to later rounds without the others (the
    smaller side of a split ran rounds ahead that way, and after the heal kept meeting only itself)."""
    return max(min_group_size, count // 2 + 1)
