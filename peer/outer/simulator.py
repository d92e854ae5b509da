"""In-process simulator: M replicas of the outer algorithm with a fake transport, no sockets.

The place where the math is tested and ablated (tests/test_streaming_reference.py, bench/): every
replica runs the real :class:`peer.outer.engine.StreamingEngine`; :class:`FakeTransport` completes
round (p, r) once all M replicas launched it, with the same semantics as the swarm's butterfly
all-reduce: each part goes through the wire codec, the token-weighted FP32 average (or, with a
``rule``, the reducer's aggregation rule over the whole vector as one span) is encoded once and every
replica decodes the same bytes.

For the attack benchmarks (bench/attacks.py) a replica's part can be ``tamper``ed with on its way in
(scaled, replaced, its weight a lie), and the transport then plays the honest reducers' defences: a part
that is not finite is refused, and with a rule, a replica with ``exclude_after`` offences (refused parts,
parts the rule kept less than OFFENCE_CLIP of) is excluded, as :mod:`peer.net.trust.exclusion` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from peer.outer.aggregate import AggregationRule, aggregate
from peer.outer.codec import Codec, get_codec
from peer.outer.rounds import RoundOutcome, RoundStatus, Span
from peer.outer.engine import StreamingEngine
from peer.outer.wire import all_finite


Tamper = Callable[[torch.Tensor, float], tuple[torch.Tensor, float]]  # (delta, weight) -> what is sent


class _Handle:
    def __init__(self, transport: "FakeTransport", key: tuple[int, int]):
        self._transport, self._key = transport, key

    def result(self, timeout: Optional[float] = None) -> RoundOutcome:
        outcome = self._transport.outcome(self._key)
        if outcome is None:
            raise TimeoutError(f"round {self._key} is still missing parts")
        return outcome

    def done(self) -> bool:
        return self._transport.outcome(self._key) is not None

    def cancel(self) -> bool:
        return False


class _Endpoint:
    def __init__(self, transport: "FakeTransport", index: int):
        self._transport, self._index = transport, index

    def launch(self, *, fragment: int, round_: int, delta: torch.Tensor, weight: float, step: int,
               expected_round: int, base=None) -> _Handle:
        self._transport.submit((fragment, round_), self._index, delta, weight)
        return _Handle(self._transport, (fragment, round_))


class FakeTransport:
    """Shared by M engines; ``endpoint(m)`` is replica m's Transport."""

    def __init__(self, num_replicas: int, codec: str | Codec = "fp32", rule: Optional[AggregationRule] = None,
                 tamper: Optional[dict[int, Tamper]] = None, exclude_after: int = 3):
        self.num_replicas = num_replicas
        self.codec = get_codec(codec)
        self.rule = rule  # None: the exact weighted mean of the decoded parts
        self.tamper = tamper or {}  # replica index -> what an attacker does to its part and weight
        self.exclude_after = exclude_after
        self.offences: dict[int, int] = {}
        self.excluded: dict[int, int] = {}  # replica index -> the round (of fragment 0's count) it was excluded
        self._parts: dict[tuple[int, int], dict[int, tuple[torch.Tensor, float]]] = {}
        self._done: dict[tuple[int, int], RoundOutcome] = {}
        self.bytes_per_round: dict[tuple[int, int], int] = {}

    def endpoint(self, index: int) -> _Endpoint:
        return _Endpoint(self, index)

    def _roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        msg = self.codec.encode_flat(x)
        return self.codec.decode_flat(msg), msg.ByteSize()

    def _offence(self, index: int, key: tuple[int, int]) -> None:
        self.offences[index] = self.offences.get(index, 0) + 1
        if self.rule is not None and self.offences[index] >= self.exclude_after:
            self.excluded.setdefault(index, key[1])

    def submit(self, key: tuple[int, int], index: int, delta: torch.Tensor, weight: float) -> None:
        parts = self._parts.setdefault(key, {})
        delta = delta.clone()
        if index in self.tamper:
            delta, weight = self.tamper[index](delta, weight)
        parts[index] = (delta, weight)
        if len(parts) == self.num_replicas:
            nbytes, kept = 0, {}
            for i in sorted(parts):
                if not all_finite(parts[i][0]):  # a reducer refuses it (peer.net.round.allreduce)
                    self._offence(i, key)
                    continue
                decoded, size = self._roundtrip(parts[i][0])
                nbytes += size
                if i not in self.excluded:
                    kept[i] = (decoded, parts[i][1])
            order = sorted(kept)
            if self.rule is not None:
                combined = aggregate([kept[i][0] for i in order], [kept[i][1] for i in order], self.rule)
                for k, i in enumerate(order):
                    if combined.offending(k):
                        self._offence(i, key)
                value, total = combined.value, combined.total_weight
            else:
                total = sum(kept[i][1] for i in order)
                acc = torch.zeros_like(delta)
                for i in order:
                    acc += kept[i][1] * kept[i][0]
                value = acc / total
            average, size = self._roundtrip(value)  # encoded once, decoded identically by all
            self.bytes_per_round[key] = nbytes + size * self.num_replicas
            self._done[key] = RoundOutcome(key[0], key[1], RoundStatus.OK, group_size=self.num_replicas,
                                           spans=[Span(0, delta.numel(), average)],
                                           contributors=[order], total_weight=total)
            del self._parts[key]

    def outcome(self, key: tuple[int, int]) -> Optional[RoundOutcome]:
        return self._done.get(key)


@dataclass
class Replica:
    """One simulated peer: ``inner_step()`` runs one inner step on its model and returns its tokens."""

    inner_step: Callable[[], int]
    engine: StreamingEngine


def run_lockstep(replicas: list[Replica], steps: int, *, start: int = 0) -> None:
    """Steps every replica ``steps`` times in lockstep: inner step, then all launches, then all applies."""
    for step in range(start + 1, start + steps + 1):
        for rep in replicas:
            rep.engine.add_tokens(rep.inner_step())
        for rep in replicas:
            rep.engine.launch_due(step)
        for rep in replicas:
            rep.engine.apply_due(step)
