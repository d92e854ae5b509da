"""Fragments: which parameters are synchronized together, and their flat fp32 views.

Issue 2 ships the whole model as one fragment (plain DiLoCo, P = 1); the partition into P fragments
of k blocks (strided / sequential) plugs in here. Every parameter belongs to exactly one fragment;
tied parameters (the same tensor under two names) count once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Fragment:
    """An ordered set of parameters synced as one vector."""

    index: int
    names: list[str]
    params: list[nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def flat(self) -> torch.Tensor:
        """A new fp32 CPU vector with the current values of the fragment's parameters."""
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        """Copies ``flat`` (fp32, length ``numel``) back into the parameters, on their device/dtype."""
        if flat.numel() != self.numel:
            raise ValueError(f"fragment {self.index}: got {flat.numel()} values for {self.numel} parameters")
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n


def unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named trainable parameters with tied tensors listed once (first name wins)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def whole_model_fragment(model: nn.Module) -> list[Fragment]:
    """P = 1: the whole model is fragment 0 (plain DiLoCo)."""
    named = unique_named_parameters(model)
    return [Fragment(0, [n for n, _ in named], [p for _, p in named])]
