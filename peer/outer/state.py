"""Outer optimizer and per-fragment outer state (pure torch, no networking): :class:`NesterovSGD`,
:class:`FragmentState`, :func:`apply_round` and the state's digests (:func:`digest_of`).

For fragment p a peer holds, in fp32 on the CPU: ``G`` (shared outer parameters, changed only by swarm aggregates)
and ``v`` (shared Nesterov momentum), bit-identical on every peer that applied the same rounds. Per peer, and only
where its settings use them: the eager terms ``E`` and ``u`` and, with error feedback, the codec's residual
(:class:`ErrorFeedback`). The inner phase's start ``S`` is not stored: it is ``G``, or ``G + E`` with ``tau = H``
(:meth:`FragmentState.sync_point`).

A round's aggregate is a list of spans, each the decoded average or ``None`` (a reducer died). Every elementwise
update touches only the spans that arrived, so peers that received the same spans stay identical, and a missing
span keeps the peer's progress in ``S - theta`` for its next round (nothing lost, nothing applied twice).
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import blake3
import numpy as np
import torch

from peer.outer import host_memory
from peer.outer.cpu_fused import nesterov_into
from peer.outer.rounds import Span
from peer.outer.wire import all_finite


@dataclass
class NesterovSGD:
    """DiLoCo's outer optimizer: ``torch.optim.SGD(nesterov=True)`` applied to the outer gradient.

    ``v <- mu*v + d``; ``G <- G - lr*(d + mu*v)``.
    """

    lr: float = 0.7
    momentum: float = 0.9

    @torch.no_grad()
    def step_(self, G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor) -> None:
        """In place on ``G`` and ``v`` (views are fine, so a span updates a slice). Each operation rounds once (no
        fused multiply-add), so the CPU and CUDA give the same bits: peers on either hold the same state."""
        v.mul_(self.momentum).add_(delta)
        G.sub_(torch.mul(v, self.momentum).add_(delta).mul_(self.lr))

    @torch.no_grad()
    def step_into(self, G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, G_out: torch.Tensor,
                  v_out: torch.Tensor) -> None:
        """:meth:`step_` from ``G, v`` into ``G_out, v_out`` (the same bits; the inputs unchanged, the outputs not
        aliasing them): no copy of the state first and no temporary; on the CPU one fused pass
        (:func:`peer.outer.cpu_fused.nesterov_into`)."""
        if nesterov_into(G, v, delta, G_out, v_out, self.momentum, self.lr):
            return
        torch.mul(v, self.momentum, out=v_out).add_(delta)
        torch.mul(v_out, self.momentum, out=G_out).add_(delta).mul_(self.lr)
        torch.sub(G, G_out, out=G_out)

    @torch.no_grad()
    def effect(self, v: torch.Tensor, delta: torch.Tensor, *, scale: float = 1.0,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """How much one step with ``scale * delta`` would move the parameters (``new G - G``), no state change:
        :meth:`step_`'s update expanded, ``-lr * (momentum^2 * v + (1 + momentum) * scale * delta)`` (equal to it
        up to rounding), in one buffer (``out``, else a new one): three passes, no temporary. Each pass rounds
        once (no fused multiply-add), so the CPU and CUDA give the same bits."""
        if out is None:
            out = torch.empty_like(v)
        k_v, k_out = self.effect_scalars(scale)
        if k_out == 0.0:
            return torch.mul(v, k_v, out=out)
        torch.mul(v, k_v, out=out)  # = c * (m^2 / c * v + delta) * -lr
        out.add_(delta)
        return out.mul_(k_out)

    def effect_scalars(self, scale: float) -> tuple[float, float]:
        """:meth:`effect`'s two factors: it is ``(v * k_v + delta) * k_out``, or ``v * k_v`` where ``k_out`` is 0."""
        c = (1.0 + self.momentum) * scale
        if c == 0.0:
            return -self.lr * self.momentum * self.momentum, 0.0
        return self.momentum * self.momentum / c, -self.lr * c


@dataclass
class FragmentState:
    """Outer state of one fragment. Must be created from the same theta_0 on every peer.

    ``E`` is allocated when ``eager_terms`` names it, ``u`` likewise (see the module docstring);
    ``E_in_sync_point`` says the inner phase starts from ``G + E`` (``tau = H``) instead of ``G``.

    ``G`` and ``v`` are replaced, never written in place, once they are the state: a published state (served to
    downloaders from another thread) shares them instead of copying them, and their digest is computed once
    (:meth:`digest_blocks`)."""

    G: torch.Tensor
    v: torch.Tensor
    E: Optional[torch.Tensor] = None  # eager jump (eager updates) or divergence from G (tau = H)
    u: Optional[torch.Tensor] = None  # eager momentum (eager updates with tau = H)
    E_in_sync_point: bool = False
    round: int = 0
    tokens_since_sync: int = 0
    applied_rounds: list[int] = field(default_factory=list)
    # (G, its version, v, its version, their block digests): the cache of digest_blocks
    _blocks: Optional[tuple] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_params(cls, flat: torch.Tensor, eager_terms: Sequence[str] = (),
                    E_in_sync_point: bool = False) -> "FragmentState":
        flat = flat.detach().to("cpu", torch.float32)
        return cls(G=flat.clone(), v=torch.zeros_like(flat),
                   E=torch.zeros_like(flat) if "E" in eager_terms else None,
                   u=torch.zeros_like(flat) if "u" in eager_terms else None, E_in_sync_point=E_in_sync_point)

    @property
    def last_applied(self) -> int:
        """The last round whose aggregate changed G (skipped, missed or lone rounds do not count):
        the round number under which this state is advertised and served."""
        return self.applied_rounds[-1] if self.applied_rounds else 0

    def sync_point(self) -> torch.Tensor:
        """``S``: where this peer's current inner phase started from (``G``, or ``G + E`` with tau = H)."""
        if self.E_in_sync_point and self.E is not None:
            return self.G + self.E
        return self.G

    def outer_gradient(self, theta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``Delta = S - theta``: how far this peer moved since its last sync of this fragment (into ``out``
        where given)."""
        return torch.sub(self.sync_point(), theta, out=out)

    def reset_eager(self) -> None:
        """Zeroes the eager terms (after an adoption, or when nothing of an eager jump is left)."""
        for term in (self.E, self.u):
            if term is not None:
                term.zero_()

    def digest(self) -> str:
        """Hex hash of the shared outer state ``G, v`` (equal on all peers after the same rounds)."""
        return digest_of_blocks(self.digest_blocks())

    def digest_blocks(self) -> list[bytes]:
        """:func:`block_digests` of ``G, v`` as they are now, computed once per state: the cache is keyed by the
        two tensors and their in-place version counters, so no writer has to remember to clear it."""
        if self._blocks is not None and self._holds(self._blocks):
            return self._blocks[4]
        blocks = block_digests(self.G, self.v)
        self.remember_blocks(blocks)
        return blocks

    def remember_blocks(self, blocks: list[bytes]) -> None:
        """Takes ``blocks`` as the :func:`block_digests` of ``G, v`` as they are now (computed elsewhere: on the
        engine's worker, or verified in a download). Not kept for inference-mode tensors (no version counter)."""
        untracked = self.G.is_inference() or self.v.is_inference()
        self._blocks = None if untracked else (self.G, self.G._version, self.v, self.v._version, list(blocks))

    def _holds(self, cached: tuple) -> bool:
        G, g_version, v, v_version, _ = cached
        return G is self.G and v is self.v and G._version == g_version and v._version == v_version


# Elements per block of the digest: a state download verifies every block it receives on its own, so parts of a
# fragment can come from different donors (peer/net/state_transfer.py). 2^16 elements: 512 KiB of G and v.
DIGEST_BLOCK = 1 << 16
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))  # for a state of 64 blocks or more per thread


def block_digests(G: torch.Tensor, v: torch.Tensor) -> list[bytes]:
    """BLAKE3-128 of each :data:`DIGEST_BLOCK`-element block's float32 bytes of ``G``, then of ``v`` (BLAKE3: a
    1B model's fragment is hashed at every round it applies, five times faster than with blake2b)."""
    g, m = (t.detach().to("cpu", torch.float32).contiguous().numpy().view(np.uint8) for t in (G, v))
    step = 4 * DIGEST_BLOCK

    def digests(starts: range) -> list[bytes]:
        out = []
        for start in starts:
            h = blake3.blake3(g[start:start + step].data)
            h.update(m[start:start + step].data)
            out.append(h.digest(16))
        return out

    starts = range(0, g.size, step)
    threads = min(HASH_THREADS, len(starts) // 64)  # (BLAKE3 lets go of the GIL: large states hash in parallel)
    if threads < 2:
        return digests(starts)
    share = -(-len(starts) // threads)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="digest") as pool:
        parts = pool.map(digests, [starts[i:i + share] for i in range(0, len(starts), share)])
        return [d for part in parts for d in part]


def digest_of_blocks(blocks: Sequence[bytes]) -> str:
    """The digest of a state whose :func:`block_digests` are ``blocks``."""
    return blake3.blake3(b"".join(blocks)).hexdigest(16)


def digest_of(G: torch.Tensor, v: torch.Tensor) -> str:
    """Hex BLAKE3-128 of the block digests of ``G, v``: the swarm-wide identity of a fragment's outer state."""
    return digest_of_blocks(block_digests(G, v))


def apply_round(state: FragmentState, theta: torch.Tensor, spans: Sequence[Span], opt: NesterovSGD,
                alpha: float, *, replay_from: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies one round's aggregate and merges it into the local weights.

    Per arrived span: ``G, v <- Nesterov(G, v, avg)``; ``E <- 0``; ``theta <- alpha*theta + (1-alpha)*G``
    (Streaming DiLoCo Alg. 2 line 12) or, with ``replay_from`` (theta at launch), ``theta <- G +
    (theta - replay_from)`` (keeps the local steps made since launch); the next phase starts from the new
    ``G`` (``S = G``, derived). Missing spans change nothing. Must be called with ``theta`` = this
    fragment's current flat fp32 parameters.
    Returns the new theta and a bool mask of the elements that received an aggregate.
    (The engine runs the same two halves apart: :func:`advanced` off the training thread as soon as the
    aggregate is in, :func:`merge_into` at ``launch + tau``.)
    """
    state.G, state.v, applied = advanced(state.G, state.v, spans, opt)  # (replaced, never written in place)
    if state.E is not None:
        state.E.masked_fill_(applied, 0)
    theta = theta.clone()
    merge_into(theta, merge_target(state.G, alpha, replay_from is not None), spans, alpha, replay_from=replay_from)
    return theta, applied


def advanced(G: torch.Tensor, v: torch.Tensor, spans: Sequence[Span],
             opt: NesterovSGD) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New ``G, v``: :func:`advance_shared` applied to copies of ``G, v`` (which are not changed), written in one
    pass (:meth:`NesterovSGD.step_into` over the arrived spans, a copy elsewhere); and the bool mask of the
    elements an aggregate arrived for."""
    n = G.numel()
    new_G, new_v = host_memory.empty_like(G), host_memory.empty_like(v)
    arrived = sorted(((s, s.average) for s in spans if s.average is not None), key=lambda a: a[0].start)
    done = covered = 0
    for span, average in arrived:
        check_average(span)
        if not done <= span.start <= span.end <= n:  # (overlapping or out of range: the general path says why)
            new_G.copy_(G)
            new_v.copy_(v)
            return new_G, new_v, advance_shared(new_G, new_v, spans, opt)
        sl = slice(span.start, span.end)
        new_G[done:span.start], new_v[done:span.start] = G[done:span.start], v[done:span.start]
        opt.step_into(G[sl], v[sl], average, new_G[sl], new_v[sl])
        done, covered = span.end, covered + span.end - span.start
    new_G[done:], new_v[done:] = G[done:], v[done:]
    if covered == n:  # (the usual round: every element arrived)
        return new_G, new_v, whole_mask(n)
    applied = torch.zeros(n, dtype=torch.bool)
    for span, _ in arrived:
        applied[span.start:span.end] = True
    return new_G, new_v, applied


def whole_mask(n: int) -> torch.Tensor:
    """The mask of a round every element of which arrived: ``n`` True values in one byte (a read-only broadcast
    view). A fragment of a 1B model would otherwise allocate, zero and free 159 MB per round, the free on the
    training thread (3-20 ms)."""
    return torch.ones(1, dtype=torch.bool).expand(n)


def advance_shared(G: torch.Tensor, v: torch.Tensor, spans: Sequence[Span], opt: NesterovSGD) -> torch.Tensor:
    """``G, v <- Nesterov(G, v, avg)`` in place on every arrived span (checked: an average of the span's length);
    returns the bool mask of the elements that received an aggregate."""
    applied = torch.zeros(G.numel(), dtype=torch.bool)
    for span in spans:
        if span.average is None:
            continue
        sl = slice(span.start, span.end)
        check_average(span)
        opt.step_(G[sl], v[sl], span.average)
        applied[sl] = True
    return applied


def check_average(span: Span) -> None:
    """Raises ``ValueError`` unless the span's average is a vector of the span's length."""
    if span.average is not None and span.average.shape != (span.end - span.start,):
        raise ValueError(f"span [{span.start}, {span.end}) got an average of shape {tuple(span.average.shape)}")


def merge_target(G: torch.Tensor, alpha: float, replay: bool) -> torch.Tensor:
    """What :func:`merge_into` adds: ``(1 - alpha) * G`` for the alpha merge, ``G`` itself for the replay merge
    and with ``alpha = 0`` (the same values: no copy). Computed ahead, on the host, so the merge at ``launch + tau``
    is one multiply-add per element."""
    return G if replay or alpha == 0.0 else (1.0 - alpha) * G


def blend(theta: torch.Tensor, target: torch.Tensor, alpha: float) -> torch.Tensor:
    """The merge's value of the weights ``theta`` moving to ``target``: ``alpha * theta + (1 - alpha) * target``."""
    if alpha == 0.0:  # (the default) the target itself: the blend changes no value but a zero's sign
        return target
    return alpha * theta + (1.0 - alpha) * target


def merge_into(theta: torch.Tensor, target: torch.Tensor, spans: Sequence[Span], alpha: float, *,
               replay_from: Optional[torch.Tensor] = None) -> None:
    """In place on ``theta``, every arrived span: ``alpha*theta + target`` (``target = (1-alpha) G``) or, with
    ``replay_from``, ``target + (theta - replay_from)`` (``target = G``). The operands may live on the
    parameters' device: the same elementwise operations give the same values there."""
    for span in spans:
        if span.average is None:
            continue
        sl = slice(span.start, span.end)
        if replay_from is not None:
            theta[sl] = target[sl] + (theta[sl] - replay_from[sl])
        else:
            theta[sl] = alpha * theta[sl] + target[sl]


class ErrorFeedback:
    """Residual of a lossy codec for one fragment (off by default; the engine owns one per fragment).

    Each round: ``x = ef.compensate(delta)`` (delta + residual), send ``x``, then
    ``ef.update(x, decoded_x)`` with ``decoded_x`` what the peers will decode from our bytes (for a
    deterministic codec ``roundtrip(x, codec)``). The residual ``x - decoded_x`` is added to the next
    round's delta, so quantization errors are delayed instead of lost.

    ``residual`` is written by its :class:`~peer.outer.engine.StreamingEngine` only: :meth:`update` on the engine's
    worker thread, anything else on the training thread once that update was waited for (one writer at a time).
    """

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None

    def compensate(self, delta: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``delta + residual`` (``delta`` itself while there is no residual), into ``out`` where given."""
        if self.residual is None:
            return delta
        if self.residual.shape != delta.shape:
            raise ValueError(f"error feedback residual has shape {tuple(self.residual.shape)}, "
                             f"delta has {tuple(delta.shape)}")
        return torch.add(delta, self.residual.to(device=delta.device, dtype=delta.dtype), out=out)

    def update(self, sent: torch.Tensor, decoded_sent: torch.Tensor) -> torch.Tensor:
        if sent.shape != decoded_sent.shape:
            raise ValueError(f"sent {tuple(sent.shape)} and decoded {tuple(decoded_sent.shape)} differ in shape")
        residual = sent.detach().to(torch.float32) - decoded_sent.detach().to(device=sent.device, dtype=torch.float32)
        if not all_finite(residual):
            raise ValueError("error feedback residual is not finite")
        self.residual = residual
        return residual

    def reset(self) -> None:
        self.residual = None

    def state_dict(self) -> dict:
        return {"residual": None if self.residual is None else self.residual.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual")
        self.residual = None if residual is None else residual.detach().to(torch.float32).clone()
