"""What a round of one fragment produced: its status and the spans of its average (pure data), and the contract
of whatever carries rounds (:class:`Transport`, :class:`Handle`).

A round's average may arrive incomplete (a reducer died): it is a list of spans, each either the decoded
average or ``None``. The transport fills a :class:`RoundOutcome`; the engine applies it only when its status is
``ok`` (:meth:`RoundOutcome.applied_spans`; an ``ok`` round may miss spans its group agreed are missing,
:func:`peer.net.trust.span_proofs.may_apply`): every peer that applies a round then holds the same state after it
(:mod:`peer.net.policy.agreement`).
"""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


class RoundStatus(enum.StrEnum):
    """How a round ended for this peer (written as its value in the JSON ``round`` events)."""

    # the average is applied: every span, or (one level) the majority every reducer's list agrees came; the one
    # status that applies it (progress is carried where a span is missing)
    OK = "ok"
    PARTIAL = "partial"  # spans are missing and the lists do not agree on a majority: nothing is applied, carried
    OFF_BASE = "off_base"  # our base differed from the group's: our part counted, nothing applied; catch up
    MINORITY = "minority"  # the group held too few of the round's peers to apply (another may): carried
    NO_GROUP = "no_group"  # no group formed: nobody came, or everyone left the round
    ALONE = "alone"  # fewer live peers than min_group_size: not launched
    BEHIND = "behind"  # the swarm is past this round, or our state is 2+ rounds behind: not launched, catch up
    FAILED = "failed"  # the round broke (an error in matchmaking or the all-reduce)
    MISSED = "missed"  # not in within wait_timeout, or abandoned at a stop

    @property
    def averaged(self) -> bool:
        """Whether our part went into an average that a group applied (ours, or the group's from another base)."""
        return self in (RoundStatus.OK, RoundStatus.PARTIAL, RoundStatus.OFF_BASE)

    @property
    def launched(self) -> bool:
        """Whether the round went to the swarm at all (ALONE and BEHIND are decided before launching)."""
        return self not in (RoundStatus.ALONE, RoundStatus.BEHIND)


@dataclass(frozen=True)
class Span:
    """Elements ``[start, end)`` of a fragment's flat vector and their averaged outer gradient
    (``None`` when this span's reducer failed: nothing is applied there)."""

    start: int
    end: int
    average: Optional[torch.Tensor]


@dataclass
class RoundOutcome:
    """What one round of one fragment produced for this peer (from the swarm or a fake transport).

    ``spans`` is empty unless ``status`` is ok/partial; ``total_weight`` is the group's summed weight.
    """

    fragment: int
    round: int
    status: RoundStatus
    group_size: int = 0
    spans: list[Span] = field(default_factory=list)
    contributors: list[list[int]] = field(default_factory=list)
    total_weight: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    error: str = ""
    launch_step: int = 0  # set by the engine: the inner step the round was launched after
    # set by the engine at the apply: seconds from the launch to the aggregate applied to copies of the state (the
    # round, then the worker's preparation: what the overlap must hide; ``seconds`` is the round's part)
    ready_seconds: float = 0.0
    deadline: float = 0.0  # seconds its group gave the all-reduce (measured deadlines follow the links); 0: none
    flagged: list[tuple[str, str]] = field(default_factory=list)  # (peer id, why): contributions our span limited
    matchmaking_seconds: float = 0.0  # from the search's start to its group (or to giving up)
    # (peer id or "(strangers)", why): who our rounds stopped waiting for at this round (peer/net/view/attendance.py)
    absent: list[tuple[str, str]] = field(default_factory=list)
    base: str = ""  # the digest of the state we declared we would apply the round to ("": not declared)
    group_base: str = ""  # the group's base (peer/net/policy/agreement.py); differs from ``base`` when off_base
    appliers: list[str] = field(default_factory=list)  # peer ids that applied the average (off_base: our donors)

    @property
    def applied(self) -> bool:
        """Whether the round's average is applied (status ``ok``)."""
        return self.status == RoundStatus.OK

    def applied_spans(self) -> list[Span]:
        """The spans the engine applies: all of them when ``ok`` (those whose ``average`` is None are missing), none
        otherwise."""
        return self.spans if self.applied else []


class Handle(Protocol):
    """A launched round. ``result`` raises ``TimeoutError`` if it is not in within ``timeout``; ``done`` says
    whether it is in (a round the transport decided not to launch is done at once)."""

    def result(self, timeout: Optional[float] = None) -> RoundOutcome: ...

    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


class Transport(Protocol):
    """Where rounds go. The engine passes what it knows: ``expected_round`` is the last round its state will
    have applied once its rounds in flight land (a transport may decide not to launch a round the swarm is
    past; that decision comes back only in the round's outcome, status ``alone`` or ``behind``), and ``base``
    resolves to ``(round, digest)`` of the state the round's average will be applied to: at once, or (tau = H)
    once the previous round of the fragment is applied; cancelled if that never happens."""

    def launch(self, *, fragment: int, round_: int, delta: torch.Tensor, weight: float, step: int,
               expected_round: int, base: "concurrent.futures.Future[tuple[int, str]]") -> Handle: ...
