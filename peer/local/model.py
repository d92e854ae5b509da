"""Decoder-only transformer in the Chinchilla style, as used by Streaming DiLoCo (with QKNorm and Z-loss 1e-4), in
plain torch (:class:`Transformer`):

- pre-norm residual blocks with RMSNorm (learnable gain, no bias anywhere);
- QK-norm: an RMSNorm over the head dimension on queries and keys, which bounds attention logits and is what
  lets the paper train without loss spikes;
- rotary position embeddings (RoPE, base 10000) on q and k after the QK-norm;
- a GELU MLP of width ``d_ff`` (the paper's Table 2 "hidden dim");
- **tied** input embedding and LM head (``logits = final_norm(h) @ tok_emb.weight.T``): one tensor, counted once
  and in exactly one fragment.

:func:`build_model` returns the model *and* the ordered list of its transformer blocks; the fragment code
partitions the blocks and puts every other parameter into exactly one fragment. A user model plugs in through
``factory="pkg.mod:fn"``, a Hugging Face causal LM through ``hf_config`` (``peer/local/hf_model.py``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ModelShape",
    "PRESETS",
    "RMSNorm",
    "Block",
    "Transformer",
    "lm_loss",
    "build_model",
    "count_parameters",
]


@dataclass(frozen=True)
class ModelShape:
    """Architecture hyper-parameters of one preset.

    ``d_model`` must be divisible by ``n_heads`` and the head dimension must be even
    (RoPE rotates pairs of channels); violating either raises ``ValueError``.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    note: str = ""

    def __post_init__(self) -> None:
        if min(self.n_layers, self.d_model, self.n_heads, self.d_ff) <= 0:
            raise ValueError(f"ModelShape sizes must be positive, got {self}")
        if self.d_model % self.n_heads != 0 or (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"ModelShape: d_model={self.d_model} must split into {self.n_heads} heads "
                "of even size (RoPE rotates channel pairs)"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Paper shapes: Streaming DiLoCo Table 2 (= Eager Updates Table 4) gives layers, heads
# and a "hidden dim" of 2048..8192 that is 4x the model width, i.e. the FFN width. The
# table does not give d_model; we use the standard Chinchilla head dim 64
# (d_model = 64 * heads), which reproduces the named sizes with vocab 32000 and tied
# embeddings (35M -> 35.3M, 100M -> 88M, 200M -> 184M, 300M -> 336M, 500M -> 559M,
# 1B -> 1.27B).
_PAPER_NOTE = "Streaming DiLoCo Table 2: layers/heads/FFN width from the paper; d_model=64*heads is our inference"
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(6, 128, 4, 512, "CPU test size: ~1.2M params at vocab 256; 6 layers = 2 fragments of 3"),
    "small": ModelShape(12, 192, 3, 768, "CPU demo size: ~5.4M params at vocab 256; 12 layers = 4 fragments of 3"),
    "35M": ModelShape(6, 512, 8, 2048, _PAPER_NOTE),
    "100M": ModelShape(9, 768, 12, 3072, _PAPER_NOTE),
    "200M": ModelShape(12, 1024, 16, 4096, _PAPER_NOTE),
    "300M": ModelShape(15, 1280, 20, 5120, _PAPER_NOTE),
    "500M": ModelShape(18, 1536, 24, 6144, _PAPER_NOTE),
    "1B": ModelShape(24, 2048, 32, 8192, _PAPER_NOTE),
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learnable gain (initialised to 1).

    Computed in float32 and cast back to the input dtype, so bf16 autocast does not
    lose precision in the mean of squares.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rope_tables(max_seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim // 2] in float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + hd/2) of x [B, H, T, hd] by position-dependent angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # Cast tables to x's dtype so q/k/v keep one dtype under autocast (SDPA requires it).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with QK-norm and RoPE (no biases)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads = shape.n_heads
        self.head_dim = shape.head_dim
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=False)
        self.out = nn.Linear(shape.d_model, shape.d_model, bias=False)
        # One gain vector per q/k, shared across heads (as in the QK-norm papers).
        self.q_norm = RMSNorm(shape.head_dim)
        self.k_norm = RMSNorm(shape.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = _apply_rope(self.q_norm(q), cos, sin)
        k = _apply_rope(self.k_norm(k), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Two-layer GELU feed-forward (Chinchilla/Gopher style, not gated): 2*d*d_ff params."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.up = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.down = nn.Linear(shape.d_ff, shape.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.d_model)
        self.mlp = MLP(shape)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model.

    Contract:
    - ``forward(tokens)`` takes int64 ``[B, T]`` with ``T <= max_seq_len`` and token ids
      in ``[0, vocab_size)`` and returns float logits ``[B, T, vocab_size]``; position
      ``t`` depends only on tokens ``0..t`` (causal).
    - Parameters: ``tok_emb.weight`` (tied: it is also the LM head), ``blocks[i].*``,
      ``final_norm.weight``. No dropout, no biases.
    - Initialisation is deterministic given the global torch RNG state (the caller
      seeds it): linear/embedding weights ~ N(0, 0.02), residual output projections
      scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual stream stays O(1) with depth.
    - The RoPE tables are non-persistent buffers: not parameters, not in state_dict.
    - ``activation_checkpointing`` (off by default): in training mode each block's activations are
      recomputed in the backward pass instead of stored; same values and gradients, less memory.
    """

    def __init__(self, shape: ModelShape, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        if vocab_size <= 0 or max_seq_len <= 0:
            raise ValueError(f"vocab_size and max_seq_len must be positive, got {vocab_size}, {max_seq_len}")
        self.shape = shape
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.final_norm = RMSNorm(shape.d_model)
        cos, sin = _rope_tables(max_seq_len, shape.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        nn.init.normal_(self.tok_emb.weight, std=std)
        resid_std = std / math.sqrt(2 * self.shape.n_layers)
        for block in typing.cast(list[Block], self.blocks):
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.out.weight, std=resid_std)
            nn.init.normal_(block.mlp.up.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=resid_std)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.max_seq_len}")
        cos, sin = typing.cast(Tensor, self.rope_cos)[:t], typing.cast(Tensor, self.rope_sin)[:t]
        x = self.tok_emb(tokens)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            # non-reentrant: works with autocast and inputs that need no grad, and keeps the RNG state
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        return F.linear(self.final_norm(x), self.tok_emb.weight)


def lm_loss(logits: Tensor, targets: Tensor, z_loss: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Next-token loss with the PaLM z-loss regulariser.

    ``logits`` ``[..., V]`` and int64 ``targets`` ``[...]``. Returns ``(total, ce)`` where
    ``ce`` is the mean cross-entropy in nats (the number compared to the entropy floor)
    and ``total = ce + z_loss * mean(logsumexp(logits)^2)``. Computed in float32 even if
    the logits are bf16. The z term keeps the softmax normaliser near 1 (log Z near 0),
    which the paper uses for stability.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss == 0.0:
        return ce, ce
    log_z = torch.logsumexp(flat, dim=-1)
    return ce + z_loss * log_z.pow(2).mean(), ce


def _load_factory(factory: str):
    module_name, sep, attr = factory.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"model factory {factory!r} must look like 'package.module:callable'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a factory module next to the user is importable
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing it
        raise ValueError(f"model factory {factory!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"model factory {factory!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Activation checkpointing for a factory's blocks: each block's ``forward`` recomputes its activations in
    the backward pass (non-reentrant) while the block is training and gradients are on."""
    for block in blocks:
        def forward(*args, _inner=block.forward, _block=block, **kwargs):
            if _block.training and torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        block.forward = forward


def build_model(
    preset: str, vocab_size: int, max_seq_len: int, factory: str | None = None, *, hf_config: str = "",
    hf_blocks: str = "", activation_checkpointing: bool = False,
) -> tuple[nn.Module, list[nn.Module]]:
    """Build a model and return ``(model, blocks)``, blocks in depth order.

    With ``factory=None`` and no ``hf_config`` the model is ``Transformer(PRESETS[preset], ...)``. With
    ``factory="pkg.mod:fn"`` the preset is ignored and ``fn(vocab_size=..., max_seq_len=...)``
    must return ``(model, blocks)``: ``blocks`` a non-empty sequence of distinct
    submodules of ``model``. Parameters outside the blocks are allowed (they go to one
    fragment). With ``hf_config`` (a Hugging Face ``config.json`` or its directory) the preset is
    ignored and the model is that causal LM, its blocks found by ``hf_blocks`` or by name (see
    ``peer/local/hf_model.py``; needs the ``hf`` extra). Raises ``ValueError`` with a one-line message
    for an unknown preset, a malformed or unimportable factory, a factory whose result breaks the
    contract, or an HF config that cannot be used (unreadable, vocabulary or length mismatch).
    ``activation_checkpointing`` recomputes each block's activations in the backward pass (training
    mode only): less memory, about a third more compute, the same values and gradients.
    Weights are initialised from the global torch RNG; build under ``torch.device("meta")``
    to count parameters without allocating memory.
    """
    if hf_config:
        if factory:
            raise ValueError("model.hf_config and model.factory are exclusive: set one of them")
        from peer.local.hf_model import build_hf_model  # lazy: transformers is the optional `hf` extra

        return build_hf_model(hf_config, vocab_size, max_seq_len, hf_blocks=hf_blocks,
                              activation_checkpointing=activation_checkpointing)
    if factory is None:
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        model = Transformer(PRESETS[preset], vocab_size, max_seq_len)
        model.activation_checkpointing = activation_checkpointing
        return model, list(model.blocks)

    fn = _load_factory(factory)
    result = fn(vocab_size=vocab_size, max_seq_len=max_seq_len)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ValueError(f"model factory {factory!r} must return (model, blocks), got {type(result).__name__}")
    model, blocks = result
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {factory!r}: model must be an nn.Module, got {type(model).__name__}")
    blocks = list(blocks) if isinstance(blocks, (list, tuple, nn.ModuleList)) else None
    if not blocks:
        raise ValueError(f"model factory {factory!r}: blocks must be a non-empty list of nn.Module")
    submodules = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module) or id(block) not in submodules or block is model:
            raise ValueError(f"model factory {factory!r}: blocks[{i}] is not a proper submodule of the model")
        if id(block) in seen:
            raise ValueError(f"model factory {factory!r}: blocks[{i}] is listed twice")
        seen.add(id(block))
    if activation_checkpointing:
        _checkpoint_blocks(blocks)
    return model, blocks


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters, each shared tensor (e.g. tied weights) counted once.

    Works on ``meta``-device models (uses ``numel`` only).
    """
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values())
