"""What every member of an assembled group agrees on before an all-reduce (pure data, no RPC): the protocol
version, which member reduces which span, the codec and the aggregation rule, checked from the members'
``MemberInfo`` that matchmaking gathered. The RPC runner is ``peer/net/round/allreduce.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

from google.protobuf.message import DecodeError
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from peer.net.policy.agreement import GroupVerdict, agree, our_count_holds, valid_base
from peer.net.trust.span_proofs import KEY_BYTES
from peer.outer.aggregate import MAX_WEIGHT, AggregationRule
from peer.outer.codec import Codec
from peer.proto import allreduce_pb2 as pb

# 2: credit on the streams to a peer with a download cap (peer/net/flow/credit.py); 3: two-level rounds (slots);
# 4: declared uplinks, and deadlines sized from them (peer/net/flow/links.py); 5: spans sized by the declared links;
# 6: declared bases and expected counts (peer/net/policy/agreement.py); 7: level-2 members declare their groups'
# sizes, and a slot's level-2 group applies with a majority only (peer/net/round/levels.py); 8: signed spans
# (peer/net/trust/span_proofs.py); 9: members' claims for their group (peer/net/trust/claims.py)
PROTOCOL_VERSION = 9
MAX_GROUP_SIZE = 256
# Span sizing by links (swarm.span_sizing = "links"): a reducer whose link is under half the group's median gets a
# share in proportion, in sixteenths of an equal one, down to 1/8 of it; the others get equal shares (a link
# measured a little slower, as loopback and LAN timings wobble, changes nothing, and claiming a fast link gains no
# span).
SHARE_UNIT, MIN_SHARE = 16, 2


def valid_weight(weight: float) -> bool:
    """A declared weight (tokens) the protocol accepts: finite, > 0 and at most MAX_WEIGHT."""
    return math.isfinite(weight) and 0 < weight <= MAX_WEIGHT


class GroupError(ValueError):
    """The assembled group's metadata is inconsistent or malformed; the round is skipped."""


def member_info(blob: bytes, numel: int) -> tuple[Optional[pb.MemberInfo], str]:
    """A member's gathered MemberInfo if the protocol accepts it (our version and fragment size, a valid weight
    and base, a span signing key if it reduces), else None and why."""
    try:
        info = pb.MemberInfo.FromString(blob)
    except DecodeError:
        return None, "unparsable member info"
    if info.protocol_version != PROTOCOL_VERSION or info.numel != numel:
        return None, (f"protocol {info.protocol_version}/numel {info.numel}, expected "
                      f"{PROTOCOL_VERSION}/{numel}")
    if not valid_weight(info.weight):
        return None, f"declared weight {info.weight}"
    if not valid_base(info):
        return None, "a malformed base digest"
    if not info.client_mode and len(info.span_key) != KEY_BYTES:  # (it would reduce a span no one can check)
        return None, "no span signing key"
    return info, ""


def holds_our_count(group: GroupInfo, numel: int, counted: Collection[str]) -> bool:
    """:func:`~peer.net.policy.agreement.our_count_holds` for an assembled group, over the members whose info
    :meth:`GroupPlan.from_group` keeps (the others are left out of the plan), of base :func:`agree`'s."""
    kept = [(str(pid), info) for pid, blob in zip(group.peer_ids, group.gathered)
            if (info := member_info(blob, numel)[0]) is not None]
    infos = [info for _, info in kept]
    return bool(infos) and our_count_holds([pid for pid, _ in kept], infos, agree(infos, two_level=False).base,
                                           counted)


def member_spans(numel: int, client_mode: Sequence[bool], align: int, shares: Sequence[int] = ()
                 ) -> list[tuple[int, int]]:
    """Splits ``[0, numel)`` into one span per member, in blocks of ``align`` elements: empty spans for
    client-mode members, and for the others shares in proportion to ``shares`` (per member, integers: see
    :func:`link_shares`), or equal shares. Integer arithmetic: every member computes the same spans."""
    reducers = [i for i, client in enumerate(client_mode) if not client]
    if not reducers:
        raise GroupError("no member of the group accepts connections (all are in client mode)")
    n_blocks = math.ceil(numel / align)
    weights = [shares[i] for i in reducers] if shares else []
    if len(set(weights)) <= 1:
        per, extra = divmod(n_blocks, len(reducers))
        weights = [per + (k < extra) for k in range(len(reducers))]  # (equal shares: the remainder first)
    total, acc, spans = sum(weights), 0, [(0, 0)] * len(client_mode)
    if total == 0:  # (nothing to split)
        return spans
    for k, i in enumerate(reducers):
        start = n_blocks * acc // total
        acc += weights[k]
        spans[i] = (min(numel, start * align), min(numel, n_blocks * acc // total * align))
    return spans


def link_shares(infos: Sequence[pb.MemberInfo]) -> list[int]:
    """Per member, its span share (``swarm.span_sizing = "links"``): a reducer receives ``n - 1`` parts of its span
    and sends ``n - 1`` copies of its average, so a span that follows its reducer's link keeps a slow reducer from
    holding up the round. The link is the declared uplink, or the declared download cap where that is lower; one
    under half the group's lower median gets ``SHARE_UNIT x link / median`` (at least MIN_SHARE), the others
    SHARE_UNIT; all equal while any is unknown (0: not measured yet). Integer arithmetic on the values every
    member received."""
    links = []
    for info in infos:
        up, down = info.upload_bytes_per_second, info.download_bytes_per_second
        link = min(up, down) if down > 0 else up
        links.append(int(min(link, 1e15)) if math.isfinite(link) and link >= 1 else 0)
    if not links or min(links) <= 0:
        return [SHARE_UNIT] * len(links)
    median = sorted(links)[(len(links) - 1) // 2]
    return [SHARE_UNIT if 2 * link >= median else max(MIN_SHARE, (SHARE_UNIT * link + median // 2) // median)
            for link in links]


def slot_bounds(numel: int, slots: int, align: int) -> list[tuple[int, int]]:
    """Cuts ``[0, numel)`` into ``slots`` consecutive slots of equal shares (in blocks of ``align``; the last ones
    may be empty): the same in every group of a two-level round, so the holders of one slot can meet."""
    return member_spans(numel, [False] * slots, align)


def slot_spans(numel: int, slots: int, client_mode: Sequence[bool], align: int
               ) -> tuple[list[tuple[int, int]], list[range]]:
    """A two-level round's spans: reducer k of the group's m reducers holds the consecutive slots
    ``[k*slots//m, (k+1)*slots//m)``, so its span is their union; client-mode members hold none. Returns the
    spans and, per member, the slots it holds."""
    reducers = [i for i, client in enumerate(client_mode) if not client]
    if not reducers:
        raise GroupError("no member of the group accepts connections (all are in client mode)")
    if len(reducers) > slots:
        raise GroupError(f"{len(reducers)} reducers for {slots} slots")
    bounds = slot_bounds(numel, slots, align)
    spans, held = [(0, 0)] * len(client_mode), [range(0)] * len(client_mode)
    for k, i in enumerate(reducers):
        held[i] = range(k * slots // len(reducers), (k + 1) * slots // len(reducers))
        spans[i] = (bounds[held[i][0]][0], bounds[held[i][-1]][1])
    return spans, held


@dataclass
class GroupPlan:
    """Everything every member agrees on about one all-reduce, derived from matchmaking's GroupInfo."""

    group_id: bytes
    peer_ids: tuple[PeerID, ...]
    infos: list[pb.MemberInfo]
    my_index: int
    numel: int
    spans: list[tuple[int, int]]
    codec: Codec
    label: str  # "fragment 0 round 7", for logs
    rule: AggregationRule = field(default_factory=AggregationRule)  # how reducers combine parts (run config)
    # per member, the cap its speed earns as our records vouch for it (aggregate.vouched_caps; None: the rule's
    # own); () for none. Local to this peer's view: only the span we reduce uses it, and every member decodes
    # that one result.
    caps: tuple[Optional[float], ...] = ()
    # two-level rounds (peer/net/round/levels.py): the slots every member declared (0: one level) and, per member, the
    # slots it holds; a reducer's average then comes from its slots' level-2 rounds
    slots: int = 0
    held: tuple[range, ...] = ()
    part_codec: Optional[Codec] = None  # how members encode their parts (None: ``codec``; level 2 uses fp8)
    verdict: Optional[GroupVerdict] = None  # which members apply the average (policy/agreement.py); None: level 2
    dropped: tuple[tuple[str, str], ...] = ()  # (peer id, why): members of the group left out of the plan

    @property
    def applies(self) -> bool:
        """Whether this member applies the group's average (the group has its quorum and our base is its)."""
        return self.verdict is None or self.verdict.quorum and self.my_index in self.verdict.appliers

    @property
    def parts(self) -> Codec:
        """The codec of the parts members send (the averages always use ``codec``)."""
        return self.part_codec or self.codec

    @classmethod
    def from_group(cls, group: GroupInfo, me: PeerID, codec: Codec, numel: int, label: str,
                   rule: Optional[AggregationRule] = None, caps: Sequence[Optional[float]] = (),
                   span_sizing: str = "equal") -> "GroupPlan":
        """Parses and checks every member's MemberInfo. A member whose info is unparsable or disagrees with ours
        (protocol, size) or is malformed (weight, base) is left out of the plan and named in ``dropped``: every
        member drops the same ones (the same infos), and the round goes on without them. Raises GroupError when
        the group itself is malformed or no other member is left. ``caps``: per member of ``group``.
        ``span_sizing`` (the run's ``swarm.span_sizing``): "links" (:func:`link_shares`) or "equal"."""
        if not 1 <= len(group.peer_ids) <= MAX_GROUP_SIZE or len(group.gathered) != len(group.peer_ids):
            raise GroupError(f"malformed group of {len(group.peer_ids)} peers")
        if me not in group.peer_ids:
            raise GroupError("this peer is not in its own group")
        infos, kept, dropped = [], [], []
        for i, (peer_id, blob) in enumerate(zip(group.peer_ids, group.gathered)):
            info, why = member_info(blob, numel)
            if info is None:
                dropped.append((str(peer_id), why))
            else:
                infos.append(info)
                kept.append(i)
        if group.peer_ids.index(me) not in kept:
            raise GroupError(f"our own member info was refused: {dict(dropped)[str(me)]}")
        if dropped and len(kept) < 2:
            raise GroupError(f"no other member sent a valid member info ({len(dropped)} dropped)")
        peer_ids = tuple(group.peer_ids[i] for i in kept)
        caps = tuple(caps[i] for i in kept) if caps else ()
        clients = [i.client_mode for i in infos]
        slots = {i.slots for i in infos}
        if len(slots - {0}) > 1 or max(slots) > MAX_GROUP_SIZE:
            raise GroupError(f"members declared different slot counts {sorted(slots)}")
        # A member that saw few live peers plans one level; any that declared slots makes the round two-level for
        # all (the same spans everywhere; each reducer then meets the other groups' holders of its slots).
        if max(slots):
            spans, held = slot_spans(numel, max(slots), clients, codec.block_size)
        else:
            shares = link_shares(infos) if span_sizing == "links" else []
            spans, held = member_spans(numel, clients, codec.block_size, shares), []
        return cls(group.group_id, peer_ids, infos, peer_ids.index(me), numel, spans,
                   codec, label, rule or AggregationRule(), caps, max(slots), tuple(held),
                   verdict=agree(infos, two_level=bool(max(slots))), dropped=tuple(dropped))
