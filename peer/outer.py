"""Outer optimizer and per-fragment outer state (pure torch, no networking).

For fragment p a peer holds, in fp32 on the CPU: ``G`` (shared outer parameters, changed only by
swarm aggregates), ``v`` (shared Nesterov momentum) and ``S`` (start point of the current inner
phase); ``G`` and ``v`` are bit-identical on every peer that applied the same rounds.

A round's aggregate may arrive incomplete (a reducer died): it is a list of spans, each either the
decoded average or ``None``. Every elementwise update below touches only the spans that arrived, so
peers that received the same spans stay identical, and a missing span keeps the peer's progress in
``S - theta`` for its next round (nothing lost, nothing applied twice).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Span:
    """Elements ``[start, end)`` of a fragment's flat vector and their averaged outer gradient
    (``None`` when this span's reducer failed: nothing is applied there)."""

    start: int
    end: int
    average: Optional[torch.Tensor]


@dataclass
class NesterovSGD:
    """DiLoCo's outer optimizer: ``torch.optim.SGD(nesterov=True)`` applied to the outer gradient.

    ``v <- mu*v + d``; ``G <- G - lr*(d + mu*v)``.
    """

    lr: float = 0.7
    momentum: float = 0.9

    @torch.no_grad()
    def step_(self, G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor) -> None:
        """In place on ``G`` and ``v`` (views are fine, so a span updates a slice)."""
        v.mul_(self.momentum).add_(delta)
        G.sub_(delta + self.momentum * v, alpha=self.lr)


@dataclass
class FragmentState:
    """Outer state of one fragment. Must be created from the same theta_0 on every peer."""

    G: torch.Tensor
    v: torch.Tensor
    S: torch.Tensor
    round: int = 0
    tokens_since_sync: int = 0
    applied_rounds: list[int] = field(default_factory=list)

    @classmethod
    def from_params(cls, flat: torch.Tensor) -> "FragmentState":
        flat = flat.detach().to("cpu", torch.float32)
        return cls(G=flat.clone(), v=torch.zeros_like(flat), S=flat.clone())

    def outer_gradient(self, theta: torch.Tensor) -> torch.Tensor:
        """``Delta = S - theta``: how far this peer moved since its last sync of this fragment."""
        return self.S - theta

    def digest(self) -> str:
        """Hex hash of the shared outer parameters G (equal on all peers after the same rounds)."""
        return hashlib.blake2b(self.G.numpy().tobytes(), digest_size=16).hexdigest()


def apply_round(state: FragmentState, theta: torch.Tensor, spans: Sequence[Span], opt: NesterovSGD,
                alpha: float) -> torch.Tensor:
    """Applies one round's aggregate and merges it into the local weights; returns the new theta.

    Per arrived span: ``G, v <- Nesterov(G, v, avg)``; ``theta <- alpha*theta + (1-alpha)*G``
    (Streaming DiLoCo Alg. 2 line 12); ``S <- G``. Missing spans change nothing.
    Must be called with ``theta`` = this fragment's current flat fp32 parameters.
    """
    theta = theta.clone()
    for span in spans:
        if span.average is None:
            continue
        sl = slice(span.start, span.end)
        if span.average.shape != (span.end - span.start,):
            raise ValueError(f"span [{span.start}, {span.end}) got an average of shape {tuple(span.average.shape)}")
        opt.step_(state.G[sl], state.v[sl], span.average)
        theta[sl] = alpha * theta[sl] + (1.0 - alpha) * state.G[sl]
        state.S[sl] = state.G[sl]
    return theta
