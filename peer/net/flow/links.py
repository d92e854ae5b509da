"""Deadlines that follow the measured links: how long a round's stages and a state download may take, from the
peers' uplinks and the fragment's size, instead of fixed seconds (pure arithmetic, no RPC).

- **Measured.** A reducer times each member's part and sends the seconds back (``ReduceResponse.part_seconds``).
  A member's parts to all reducers leave through its uplink at once, so their bytes over the longest time bound
  its uplink from below (:class:`LinkMeter`). It declares that rate, at most its owner's upload cap, in
  ``MemberInfo.upload_bytes_per_second`` and in its progress record; its downlink it keeps to itself.
- **Sized.** Every member computes the same deadlines from the same infos (:func:`round_deadlines`); a joiner
  gives each state donor the time set by the donor's declared uplink or its own downlink (:func:`state_deadline`).
- **Bounded.** The run's fixed settings (``part_timeout``, ``allreduce_timeout``, ``state_timeout``) are the
  floors; ``deadline_max`` is the ceiling, so a member that declares a tiny uplink stalls its groups no longer.

Design, rationale and hostile input: docs/architecture.md, "Deadlines that follow the links".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, TypeVar

import torch

from peer.config import SwarmConfig
from peer.net.flow.bandwidth import share
from peer.net.round.group import GroupPlan
from peer.outer.codec import Codec

K = TypeVar("K")


@dataclass(frozen=True, kw_only=True)
class DeadlinePolicy:
    """How a peer sizes its deadlines (the run's ``swarm.deadlines`` settings)."""

    measured: bool = True  # False: the fixed settings, whatever the links
    part_floor: float = 30.0  # swarm.part_timeout: a reducer waits at least this for members' parts
    allreduce_floor: float = 60.0  # swarm.allreduce_timeout: a member waits at least this for every span
    state_floor: float = 60.0  # swarm.state_timeout: a donor gets at least this for its part of a state
    margin: float = 3.0  # swarm.deadline_margin: a stage's deadline is this times its expected seconds
    ceiling: float = 600.0  # swarm.deadline_max: no deadline is longer (a lying member stalls at most this)

    @classmethod
    def of(cls, cfg: SwarmConfig) -> "DeadlinePolicy":
        return cls(measured=cfg.deadlines == "measured", part_floor=cfg.part_timeout,
                   allreduce_floor=cfg.allreduce_timeout, state_floor=cfg.state_timeout,
                   margin=cfg.deadline_margin, ceiling=cfg.deadline_max)


@dataclass(frozen=True)
class RoundDeadlines:
    """One round's deadlines, seconds from the group's formation (the same for every member of the group)."""

    part: float  # a reducer waits this long for members' parts, then combines what it has
    allreduce: float  # a member waits this long for every averaged span
    expected: float = 0.0  # the transfer seconds the declared links predict (both stages; 0: none declared)


_PER_ELEMENT: dict[tuple[str, int, int], float] = {}  # (codec name, version, block size) -> bytes per element


def _bytes_per_element(codec: Codec) -> float:
    key = (codec.name, codec.version, codec.block_size)
    if key not in _PER_ELEMENT:
        sample = 1 << 14  # whole blocks of every codec: the scales' and the message's overhead included
        _PER_ELEMENT[key] = codec.encode_flat(torch.ones(sample)).ByteSize() / sample
    return _PER_ELEMENT[key]


def wire_bytes(codec: Codec, numel: int) -> float:
    """About the bytes ``numel`` elements take on the wire in ``codec`` (protobuf framing included)."""
    return numel * _bytes_per_element(codec)


def declared(rate: float) -> Optional[float]:
    """A declared rate in bytes/s as the deadlines use it: None when not declared (0) or not finite (hostile), at
    least :data:`~peer.net.flow.bandwidth.MIN_RATE` otherwise (as senders take it:
    :func:`~peer.net.flow.bandwidth.share`)."""
    return share(rate, 1) or None


def _slowest(amounts: Sequence[float], rates: Sequence[Optional[float]]) -> float:
    """The longest ``amount / rate`` over the entries whose rate is declared (0 if none)."""
    return max((a / r for a, r in zip(amounts, rates) if r is not None and a > 0), default=0.0)


def round_deadlines(spans: Sequence[tuple[int, int]], uplinks: Sequence[float], downlinks: Sequence[float],
                    parts: Codec, averages: Codec, policy: DeadlinePolicy) -> RoundDeadlines:
    """A one-level round's deadlines from the group's spans and every member's declared uplink and download cap
    (bytes/s, 0: none), ``parts``/``averages`` the codecs of the two stages. Deterministic: every member of a
    group computes the same from the same MemberInfos."""
    if not policy.measured:
        return RoundDeadlines(policy.part_floor, policy.allreduce_floor)
    n = len(spans)
    up, down = [declared(r) for r in uplinks], [declared(r) for r in downlinks]
    part = [wire_bytes(parts, end - start) for start, end in spans]
    avg = [wire_bytes(averages, end - start) for start, end in spans]
    # stage 1: member i sends its part of every other member's span at once; reducer j reads n - 1 parts
    sends = _slowest([sum(part) - part[i] for i in range(n)], up)
    reads = _slowest([(n - 1) * part[j] for j in range(n)], down)
    # stage 2: reducer j sends its average to the n - 1 others; member i reads every other span's average
    shares = _slowest([(n - 1) * avg[j] for j in range(n)], up)
    gathers = _slowest([sum(avg) - avg[i] for i in range(n)], down)
    stage1, stage2 = max(sends, reads), max(shares, gathers)
    # the average stage keeps at least the fixed settings' gap, also when the part stage reaches the ceiling
    gap = policy.allreduce_floor - policy.part_floor
    part_deadline = min(max(policy.part_floor, policy.margin * stage1), max(policy.part_floor, policy.ceiling - gap))
    allreduce = min(max(policy.allreduce_floor, part_deadline + max(gap, policy.margin * stage2)),
                    max(policy.allreduce_floor, policy.ceiling))
    return RoundDeadlines(part_deadline, allreduce, stage1 + stage2)


def plan_deadlines(plan: GroupPlan, policy: DeadlinePolicy) -> RoundDeadlines:
    """:func:`round_deadlines` of an assembled group, from its members' infos."""
    return round_deadlines(plan.spans, [i.upload_bytes_per_second for i in plan.infos],
                           [i.download_bytes_per_second for i in plan.infos], plan.parts, plan.codec, policy)


def state_deadline(numel: int, donors: int, donor_uplink: float, policy: DeadlinePolicy, downlink: float = 0.0,
                   uploads_at_once: int = 2) -> float:
    """Seconds a joiner gives one donor for its share of a fragment's state (``numel`` elements of G and v in
    fp32, cut between ``donors``), when the donor declared ``donor_uplink`` bytes/s and serves up to
    ``uploads_at_once`` downloads side by side (the default ``max_state_uploads``), and the joiner's own
    ``downlink`` (measured or capped; 0: unknown) is shared by the ``donors``."""
    rates = [r / n for r, n in ((declared(donor_uplink), uploads_at_once), (declared(downlink), max(1, donors)))
             if r is not None]
    if not policy.measured or not rates:
        return policy.state_floor
    share = 8 * numel / max(1, donors)
    return min(policy.ceiling, max(policy.state_floor, policy.margin * share / min(rates)))


def slow_donors_last(uplinks: Mapping[K, float]) -> list[K]:
    """State donors in the order to try them: those whose declared uplink (bytes/s) is under a quarter of the best
    declared go last; the order is kept otherwise (the caller's order spreads joiners over the fast ones, and a
    donor that declared nothing is not taken for slow)."""
    best = max((r for r in uplinks.values() if math.isfinite(r)), default=0.0)
    return sorted(uplinks, key=lambda d: 0 < uplinks[d] < best / 4)


class LinkMeter:
    """One direction of this peer's link in bytes/s, from timed transfers (uplink: the part times its reducers
    reported; downlink: the averages it read).

    A slower sample is taken at once (a link that slowed must not keep its old deadlines for rounds); a faster
    one moves the estimate by ``smoothing`` (one quick round, e.g. when few bytes were in flight, must not shrink
    the next round's deadlines). Samples of fewer than ``min_bytes`` are too short to time and are skipped.

    The estimate is written by :meth:`observe` only, on ``swarm-net`` (``Swarm.learn``); :meth:`rate` reads it from
    any thread (one float).
    """

    def __init__(self, smoothing: float = 0.3, min_bytes: int = 64 << 10):
        self.smoothing, self.min_bytes = smoothing, min_bytes
        self._rate: Optional[float] = None

    def observe(self, sent_bytes: int, seconds: float) -> None:
        """Adds one round's sample: ``sent_bytes`` that took ``seconds`` until the last was read."""
        if sent_bytes < self.min_bytes or not (math.isfinite(seconds) and seconds > 0):
            return
        sample = sent_bytes / seconds
        if self._rate is None or sample < self._rate:
            self._rate = sample
        else:
            self._rate += self.smoothing * (sample - self._rate)

    def rate(self, cap: float = 0.0) -> float:
        """The rate to use: the measured one, at most ``cap`` (the owner's cap of that direction, bytes/s, 0: none);
        the cap alone before any sample; 0 when neither is known."""
        if self._rate is None:
            return cap
        return min(self._rate, cap) if cap > 0 else self._rate
