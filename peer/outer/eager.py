"""Eager updates (docs/algorithm.md): our own share of a round applied at its launch, before the aggregate is in.

With ``0 < tau < H`` and eager on, a launch moves the fragment's weights from ``theta`` to ``G + E``,
``E = effect(v, share * Delta)``; the aggregate corrects it at ``launch + tau``, and where nothing arrives the jump
is undone (it is kept with its round in flight, E itself is not). With ``tau = H`` the same share scales the eager
machine's step. ``share`` is w / W, our expected part of the group's weight, estimated as our part in the fragment's
last aggregate (1/M for equal peers until one arrived; phases of different length cancel out).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from peer.outer.cpu_fused import eager_jump
from peer.outer.fragments import Fragment
from peer.outer.offload import HostBuffers, scatter
from peer.outer.state import NesterovSGD, blend


class Eager:
    """The engine's share estimate and eager jumps. ``last_share`` (per fragment, saved in checkpoints) is written by
    the training thread only: :meth:`record` at each apply, the engine at a checkpoint's restore."""

    def __init__(self, fragments: list[Fragment], opt: NesterovSGD, buffers: HostBuffers, *, alpha: float,
                 replay: bool, group_size_hint: Callable[[], int]):
        """``alpha``, ``replay``: the merge's (the jump lands where the merge would); ``group_size_hint()``: the
        group's size to expect, for the share before any aggregate arrived."""
        self.fragments, self.opt, self.buffers = fragments, opt, buffers
        self.alpha, self.replay, self.group_size_hint = alpha, replay, group_size_hint
        self.last_share: list[Optional[float]] = [None] * len(fragments)  # our w/W in the last aggregate

    def share(self, p: int) -> float:
        """w / W: this peer's expected share of the group's weight in fragment ``p``'s next round."""
        return self.last_share[p] or 1.0 / max(1, self.group_size_hint())

    def record(self, p: int, weight: float, total_weight: float) -> None:
        """Fragment ``p``'s aggregate arrived, of ``total_weight``, ours being ``weight``."""
        if total_weight > 0:
            self.last_share[p] = min(1.0, weight / total_weight)

    def jump(self, p: int, theta: Optional[torch.Tensor], delta: torch.Tensor, G: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Moves fragment ``p``'s weights from ``theta`` (None: the parameters as they are, on the CPU) to ``G + E``,
        ``E = effect(v, share * delta)``: our own share of the round, applied now; the aggregate corrects it when it
        arrives. Returns the jump (kept with the round: all that its apply needs to undo where nothing arrived; E
        itself is not kept) and the weights jumped to (None where ``theta`` was). ``theta``'s buffer becomes the
        jump's; ``E`` is computed in a pooled buffer (a fresh fragment-sized buffer costs more in page faults than
        its arithmetic) and given back here (the replay merge keeps its own copy of the weights jumped to, ``term +
        G``). With the alpha = 0 merge on the CPU, all of it is one pass over the parameters
        (:func:`peer.outer.cpu_fused.eager_jump`), and nothing but the jump is allocated."""
        if theta is None:
            frag = self.fragments[p]
            jump = self.buffers.take(frag.numel)
            k_v, k_out = self.opt.effect_scalars(self.share(p))
            if self.alpha == 0.0 and not self.replay and k_out != 0.0 \
                    and eager_jump(frag.params, G, v, delta, jump, k_v, k_out):
                return jump, None
            theta = frag.flat(out=jump)
        scratch = self.buffers.take(theta.numel()) if theta.device.type == "cpu" else torch.empty_like(theta)
        term = self.opt.effect(v, delta, scale=self.share(p), out=scratch)
        # (G + E and E + G are the same bits)
        merged = blend(theta, term + G if self.replay else term.add_(G), self.alpha)
        scatter(self.fragments[p], merged)
        jump = torch.sub(merged, theta, out=theta)
        self.buffers.give(scratch)
        return jump, merged
