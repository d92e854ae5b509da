"""Fragments: which parameters are synchronized together, and their flat fp32 views.

Streaming DiLoCo splits the L transformer blocks into P = ceil(L / k) fragments of k blocks:

- ``strided`` (default, the paper's choice): fragment p = blocks {p, p+P, p+2P, ...};
- ``sequential``: fragment p = blocks [p*k, (p+1)*k).

Parameters outside the blocks follow their position in the model: those registered before the
first block (token embedding, which is also the tied LM head) go with the fragment holding block 0;
those after the last block (final norm, an untied head) go with the fragment holding block L-1.
So every parameter is in exactly one fragment, tied tensors count once, and P = 1 (k >= L) is plain
DiLoCo with the whole model as fragment 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

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

    def flat(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """An fp32 CPU vector with the current values of the fragment's parameters: a new one, or ``out``."""
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params], out=out)

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


def block_assignment(num_blocks: int, blocks_per_fragment: int, pattern: str) -> list[int]:
    """Fragment index of each block, for ``strided`` or ``sequential`` patterns."""
    if num_blocks < 1 or blocks_per_fragment < 1:
        raise ValueError(f"need >= 1 block and >= 1 block per fragment (got {num_blocks}, {blocks_per_fragment})")
    P = math.ceil(num_blocks / blocks_per_fragment)
    if pattern == "strided":
        return [b % P for b in range(num_blocks)]
    if pattern == "sequential":
        return [b // blocks_per_fragment for b in range(num_blocks)]
    raise ValueError(f"unknown fragment pattern {pattern!r}; use strided or sequential")


def partition(model: nn.Module, blocks: Sequence[nn.Module], blocks_per_fragment: int,
              pattern: str = "strided") -> list[Fragment]:
    """Splits the model's trainable parameters into fragments (see the module docstring).

    ``blocks_per_fragment = 0`` (or >= len(blocks)) gives one fragment: plain DiLoCo.
    """
    named = unique_named_parameters(model)
    k = blocks_per_fragment if 0 < blocks_per_fragment < len(blocks) else max(len(blocks), 1)
    owner_of_block = block_assignment(max(len(blocks), 1), k, pattern)
    param_block: dict[int, int] = {}
    for b, block in enumerate(blocks):
        for p in block.parameters():
            param_block.setdefault(id(p), b)
    if not param_block and blocks:
        raise ValueError("the model's blocks have no parameters")
    P = max(owner_of_block) + 1
    names: list[list[str]] = [[] for _ in range(P)]
    params: list[list[nn.Parameter]] = [[] for _ in range(P)]
    seen_block = False
    for name, p in named:
        if id(p) in param_block:
            seen_block = True
            frag = owner_of_block[param_block[id(p)]]
        else:  # outside the blocks: before the first block -> block 0's fragment, after -> last block's
            frag = owner_of_block[-1] if seen_block else owner_of_block[0]
        names[frag].append(name)
        params[frag].append(p)
    return [Fragment(i, names[i], params[i]) for i in range(P)]
