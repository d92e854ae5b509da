"""Plain transcriptions of the papers' outer algorithms, written independently of ``peer/``.

Nothing here imports the implementation under test: the outer optimizer is ``torch.optim.SGD(nesterov=True)``,
the schedule arithmetic, the fragment assignment and the bookkeeping are written out again from the papers:

- :func:`diloco` -- DiLoCo, Algorithm 1 of the eager-updates paper (arXiv 2502.12996): every H steps each replica
  computes ``Delta_m = theta_m^(t-H) - theta_m^(t)``, the replicas average, and every replica applies
  ``OuterOpt(theta_m^(t-H), Delta)`` (replicated outer state) and continues from the result.
- :func:`streaming_diloco` -- Streaming DiLoCo, Algorithm 2 (arXiv 2501.18512): fragment p syncs at step t when
  ``(t - t_p) mod H == 0`` and ``t - t_p > 0``, ``t_p = round(p*H/P)``; its outer gradient is
  ``global_p - theta_{m,p}`` at launch; at ``t + tau`` the average is applied to ``global_p`` by the outer
  optimizer and every replica merges ``theta_{m,p} <- alpha*theta_{m,p} + (1-alpha)*global_p``.
  (With tau = 0 the receive happens right after the send, in the same step: blocking DiLoCo.)
- :func:`eager_one_outer_step` -- Algorithm 3 (eager updates, ``eager=True``) and Algorithm 2 (naive delayed
  outer gradients, ``eager=False``) of the eager-updates paper, P = 1: each replica keeps its own outer
  parameters and outer optimizer; at t = H nothing is applied; from t = 2H on it receives ``Delta^(t-H)`` and
  applies ``OuterOpt(theta_m^(t-H), Delta~_m)`` with ``Delta~_m = (1/M)(Delta_m^(t) - Delta_m^(t-H)) +
  Delta^(t-H)`` (eager) or ``Delta~_m = Delta^(t-H)`` (naive). With ``fragments`` (P > 1) the same algorithm
  runs per fragment on the streaming schedule above (docs/algorithm.md section 5: "at each sync event of p").

The toy problem (:class:`ToyNet`, :class:`ToyReplica`) is shared by the reference run and the engine run so that
both see identical initial weights, data streams and inner optimizers; only the outer algorithm differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

Params = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------ toy problem
class ToyNet(nn.Module):
    """A tiny residual MLP: ``inp`` (before the blocks), ``blocks`` (a list of L linear layers), ``head`` (after)."""

    def __init__(self, *, num_blocks: int = 6, width: int = 8, d_in: int = 6, init_seed: int = 1234):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 1)
        gen = torch.Generator().manual_seed(init_seed)  # identical weights on every replica
        with torch.no_grad():
            for _, p in self.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


class ToyReplica:
    """Replica m: a :class:`ToyNet`, its own deterministic regression stream (teacher and batches seeded by m) and
    an inner optimizer that keeps its state across outer rounds. ``inner_step()`` returns the tokens it used."""

    BATCH = 16

    def __init__(self, m: int, *, num_blocks: int = 6, width: int = 8, d_in: int = 6, inner: str = "sgd"):
        self.model = ToyNet(num_blocks=num_blocks, width=width, d_in=d_in)
        self.gen = torch.Generator().manual_seed(1000 + m)
        self.teacher = torch.randn(d_in, 1, generator=self.gen)
        if inner == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.5, foreach=False)
        elif inner == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
        else:
            raise ValueError(inner)

    def inner_step(self) -> int:
        x = torch.randn(self.BATCH, self.teacher.shape[0], generator=self.gen)
        y = torch.sin(x @ self.teacher) + 0.1 * torch.randn(self.BATCH, 1, generator=self.gen)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return self.BATCH

    def params(self) -> Params:
        """A copy of the current parameters, by name."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def load(self, values: Params) -> None:
        """Overwrites the named parameters (in place: the inner optimizer keeps its state)."""
        named = dict(self.model.named_parameters())
        for n, v in values.items():
            named[n].copy_(v)


def make_replicas(M: int, **kw) -> list[ToyReplica]:
    return [ToyReplica(m, **kw) for m in range(M)]


def strided_fragments(num_blocks: int, P: int) -> list[list[str]]:
    """The project's strided split, written out for :class:`ToyNet`: block b goes to fragment ``b % P``;
    ``inp`` (registered before the blocks) goes with block 0, ``head`` (after them) with block L-1."""
    frags: list[list[str]] = [[] for _ in range(P)]
    frags[0] += ["inp.weight", "inp.bias"]
    for b in range(num_blocks):
        frags[b % P] += [f"blocks.{b}.weight", f"blocks.{b}.bias"]
    frags[(num_blocks - 1) % P] += ["head.weight", "head.bias"]
    return frags


# ------------------------------------------------------------------------------------------ outer optimizer
class OuterOpt:
    """Outer parameters plus their outer optimizer state: ``torch.optim.SGD(lr, momentum, nesterov=True)``
    fed with the outer gradient as ``.grad`` (DiLoCo's OuterOpt)."""

    def __init__(self, values: Params, lr: float, momentum: float):
        self.params = {n: v.detach().clone().requires_grad_(True) for n, v in values.items()}
        self.opt = torch.optim.SGD(list(self.params.values()), lr=lr, momentum=momentum, nesterov=True,
                                   foreach=False)

    def step(self, outer_grad: Params) -> None:
        for n, p in self.params.items():
            p.grad = outer_grad[n].clone()
        self.opt.step()

    @torch.no_grad()
    def reset_params(self, values: Params) -> None:
        """Sets the outer parameters (the optimizer state is kept)."""
        for n, p in self.params.items():
            p.copy_(values[n])

    def values(self) -> Params:
        return {n: p.detach().clone() for n, p in self.params.items()}


def _sub(a: Params, b: Params) -> Params:
    return {n: a[n] - b[n] for n in a}


def _mean(deltas: list[Params]) -> Params:
    return {n: torch.stack([d[n] for d in deltas]).mean(0) for n in deltas[0]}


def _only(values: Params, names: list[str]) -> Params:
    return {n: values[n] for n in names}


@dataclass
class Result:
    replicas: list[Params]
    """Final parameters of every replica."""
    outer: list[Params] = field(default_factory=list)
    """Outer parameters: per replica (Alg. 1, Alg. 3: theta_m^(t-H) after the last sync, all fragments), or per
    fragment (Streaming Alg. 2: global_p)."""
    shared: Optional[Params] = None
    """Alg. 3 only: theta_0 stepped by OuterOpt with the received averages Delta^(t-H) alone (docs/algorithm.md
    section 5's shared G; the papers do not name it)."""
    history: list[tuple[int, int, Params]] = field(default_factory=list)
    """(step, fragment, outer params of that fragment after the step's outer update)."""


# ------------------------------------------------------------------------------------------ Algorithm 1
def diloco(replicas: list[ToyReplica], *, H: int, T: int, lr: float = 0.7, momentum: float = 0.9) -> Result:
    """DiLoCo (eager paper Alg. 1): replica m keeps theta_m^(t-H) and its (replicated) OuterOpt state."""
    M = len(replicas)
    outer = [OuterOpt(r.params(), lr, momentum) for r in replicas]  # theta_m^(0)
    history = []
    for t in range(1, T + 1):
        for r in replicas:                                     # L8-10: x ~ D_m; inner step
            r.inner_step()
        if t % H == 0:                                         # L12
            deltas = [_sub(outer[m].values(), replicas[m].params()) for m in range(M)]  # L13
            avg = _mean(deltas)                                # L14-15: average, block-receive
            for m in range(M):                                 # L16: theta_m^(t) <- OuterOpt(theta_m^(t-H), Delta)
                outer[m].step(avg)
                replicas[m].load(outer[m].values())
            history.append((t, 0, outer[0].values()))
    return Result([r.params() for r in replicas], [o.values() for o in outer], history=history)


# ------------------------------------------------------------------------------------------ Streaming Alg. 2
def fragment_offsets(P: int, H: int) -> list[int]:
    return [round(p * H / P) for p in range(P)]


def streaming_diloco(replicas: list[ToyReplica], *, H: int, T: int, fragments: list[list[str]], tau: int,
                     alpha: float, lr: float = 0.7, momentum: float = 0.9) -> Result:
    """Streaming DiLoCo Alg. 2 with P = len(fragments), overlap tau (0 <= tau < H) and merge alpha."""
    assert 0 <= tau < H
    M, P = len(replicas), len(fragments)
    theta0 = replicas[0].params()
    glob = [OuterOpt(_only(theta0, names), lr, momentum) for names in fragments]  # global_p + its OuterOpt
    offsets = fragment_offsets(P, H)
    in_flight: list[tuple[int, int, Params]] = []  # (step to apply at, p, averaged outer gradient)
    history = []
    for t in range(1, T + 1):
        for r in replicas:
            r.inner_step()
        for p in range(P):                                     # sync of fragment p due: send
            if t - offsets[p] > 0 and (t - offsets[p]) % H == 0:
                g = glob[p].values()
                deltas = [_sub(g, _only(r.params(), fragments[p])) for r in replicas]
                in_flight.append((t + tau, p, _mean(deltas)))
        for item in [i for i in in_flight if i[0] == t]:       # tau steps later: receive, outer step, merge
            in_flight.remove(item)
            _, p, avg = item
            glob[p].step(avg)
            g = glob[p].values()
            for r in replicas:
                theta = _only(r.params(), fragments[p])
                r.load({n: alpha * theta[n] + (1.0 - alpha) * g[n] for n in fragments[p]})
            history.append((t, p, g))
    assert M == len(replicas)
    return Result([r.params() for r in replicas], [o.values() for o in glob], history=history)


# ------------------------------------------------------------------------------------------ eager Alg. 3 / Alg. 2
def eager_one_outer_step(replicas: list[ToyReplica], *, H: int, T: int, eager: bool, lr: float = 0.7,
                         momentum: float = 0.9, fragments: Optional[list[list[str]]] = None) -> Result:
    """Eager paper Alg. 3 (eager) / Alg. 2 (naive delayed): per-replica outer parameters and OuterOpt.

    ``fragments=None`` is the paper's P = 1. With P > 1 fragments the same algorithm runs per fragment on
    Streaming DiLoCo's schedule (fragment p's events at ``t_p + r*H``, docs/algorithm.md section 5: "at each sync
    event of p"); the eager scale stays the paper's 1/M.
    """
    M = len(replicas)
    theta0 = replicas[0].params()
    fragments = fragments or [list(theta0)]
    P = len(fragments)
    offsets = fragment_offsets(P, H)
    # theta_{m,p}^(t-H) and replica m's OuterOpt for fragment p
    outer = [[OuterOpt(_only(r.params(), names), lr, momentum) for names in fragments] for r in replicas]
    shared = [OuterOpt(_only(theta0, names), lr, momentum) for names in fragments]  # theta_0 + received averages
    prev_delta: list[list[Optional[Params]]] = [[None] * P for _ in range(M)]  # Delta_{m,p}^(t-H)
    prev_avg: list[Optional[Params]] = [None] * P                             # Delta_p^(t-H)
    history = []
    for t in range(1, T + 1):
        for r in replicas:
            r.inner_step()
        for p, names in enumerate(fragments):
            if not (t - offsets[p] > 0 and (t - offsets[p]) % H == 0):       # L12 (t mod H == 0 for P = 1)
                continue
            deltas = [_sub(outer[m][p].values(), _only(replicas[m].params(), names)) for m in range(M)]  # L13
            avg = _mean(deltas)                                                 # L14: async-send
            if t - offsets[p] > H:                                              # L15: t > H
                for m in range(M):                                              # L16: block-receive Delta^(t-H)
                    if eager:                                                   # L17 (Alg. 3)
                        tilde = {n: (deltas[m][n] - prev_delta[m][p][n]) / M + prev_avg[p][n] for n in names}
                    else:                                                       # Alg. 2 L17
                        tilde = prev_avg[p]
                    outer[m][p].step(tilde)                                     # theta_m^(t)
                    replicas[m].load(outer[m][p].values())
                shared[p].step(prev_avg[p])
                history.append((t, p, shared[p].values()))
            else:  # first event: nothing applied; theta_m^(t) (local) is the next phase's theta_m^(t-H)
                for m in range(M):
                    outer[m][p].reset_params(_only(replicas[m].params(), names))
            for m in range(M):
                prev_delta[m][p] = deltas[m]
            prev_avg[p] = avg
    merged_outer = [{n: v for o in outer[m] for n, v in o.values().items()} for m in range(M)]
    merged_shared = {n: v for o in shared for n, v in o.values().items()}
    return Result([r.params() for r in replicas], merged_outer, shared=merged_shared, history=history)
