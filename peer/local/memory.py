"""How much device memory one peer's training takes at its peak (:func:`estimate`): a model that ``swarm-peer doctor``
reads against the card's memory, and that ``bench/gpu.py`` checks against what it measures.

The peak is the larger of two moments of an inner step. Without micro-batching, the start of the backward pass:
weights and AdamW's two moments (12 bytes per parameter; 6 with 8-bit moments), the activations every block saved
for backward, and the loss's copies of the logits; the gradients are not allocated yet. With micro-batching, the
later chunks run while the earlier ones' gradients are held (4 bytes per parameter more), each chunk's activations
and logits sized by the chunk. Activation checkpointing keeps one input per block and recomputes a block at a time.
On CUDA the bf16 autocast also caches a bf16 copy of the weights, and the device path (``outer.state_on_device``)
keeps two fp32 copies of the outer state there: of every fragment, or of the rolling residency's few.

The per-element constants are measured: on the CPU by tracking every storage an inner step allocates
(tests/test_memory_model.py), on CUDA from the H200's peaks (docs/benchmarks.md, "A memory model").
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from peer.local.model import PRESETS, ModelShape

GIB = 2**30
HEADROOM = 0.9  # of a device's memory a setting may plan to use: the allocator's blocks are not all reusable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constants:
    """Bytes per element of the saved tensors, in units of one fp32 value (4 bytes)."""

    block: float  # one block's saved activations, per token and model dimension
    kept: float  # what activation checkpointing keeps per block (its input), per token and model dimension
    logits: float  # the loss's copies of the logits, per token and vocabulary entry
    weight_cache: int  # bytes per parameter of autocast's low-precision weight copies
    step_temporaries: float  # bytes per parameter the optimizer step allocates beside weights, moments and gradients


# CPU (fp32, no autocast): fitted to the storages an inner step allocates (tiny and small presets, 8 settings)
CPU = Constants(block=22.7, kept=1.0, logits=5.7, weight_cache=0, step_temporaries=1.0)
# CUDA (bf16 autocast, fused AdamW): the H200's peaks of 2026-11-26 (100M and 1B, whole batch) fit the block term;
# the residual stream is fp32, so a checkpointed input costs what it does on the CPU
CUDA = Constants(block=17.5, kept=1.0, logits=5.2, weight_cache=2, step_temporaries=0.0)  # (fused AdamW)


def block_parameters(shape: ModelShape) -> int:
    """Trainable parameters of one block of :class:`~peer.local.model.Transformer` (no biases)."""
    head_dim = shape.d_model // shape.n_heads
    return 4 * shape.d_model**2 + 2 * shape.d_model * shape.d_ff + 2 * shape.d_model + 2 * head_dim


def parameters(shape: ModelShape, vocab_size: int) -> int:
    """Trainable parameters of :class:`~peer.local.model.Transformer` (tied embedding, no biases)."""
    return vocab_size * shape.d_model + shape.n_layers * block_parameters(shape) + shape.d_model


def largest_fragment(shape: ModelShape, vocab_size: int, fragment_blocks: int) -> int:
    """Elements of the largest fragment: ``fragment_blocks`` blocks and the embedding (which goes with the first)."""
    blocks = min(fragment_blocks, shape.n_layers)
    return min(parameters(shape, vocab_size), blocks * block_parameters(shape) + (vocab_size + 1) * shape.d_model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """Peak device bytes of one peer's training, by part."""

    weights_and_optimizer: int  # fp32 weights, AdamW's two moments, and the gradients where they coexist
    weight_cache: int
    activations: int  # what the blocks keep for backward at the peak (checkpointed inputs, one block recomputed)
    logits: int
    outer_state: int  # the device path's copies of G and v (of every fragment, or of the rolling residency's)
    step: int  # the other moment: the optimizer step (weights, moments, gradients and its temporaries)

    @property
    def total(self) -> int:
        training = self.weights_and_optimizer + self.weight_cache + self.activations + self.logits
        return max(training, self.step) + self.outer_state


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """What one peer trains with, as far as memory goes."""

    preset: str
    vocab_size: int
    seq_len: int
    batch_size: int
    micro_batch: int = 0  # 0: the whole batch at once
    activation_checkpointing: bool = False
    state_on_device: "bool | str" = False  # outer.state_on_device: True (every fragment's copy), "rolling", False
    rolling_copies: int = 3  # the copies a rolling residency holds (peer.outer.schedule.rolling_copies)
    fragment_blocks: int = 3  # outer.fragment_blocks
    optimizer: str = "adamw"  # or adamw8bit (inner.optimizer)

    def describe(self) -> str:
        parts = [f"micro_batch {self.micro_batch}" if self.micro_batch else "whole batch"]
        parts += ["activation checkpointing"] if self.activation_checkpointing else []
        if self.state_on_device:
            parts += [f"outer state on the device ({'rolling' if self.state_on_device == 'rolling' else 'on'})"]
        parts += ["8-bit AdamW"] if self.optimizer == "adamw8bit" else []
        return ", ".join(parts)


def estimate(setting: Setting, constants: Constants = CUDA) -> Estimate:
    """The peak of an inner step of ``setting`` (see the module docstring)."""
    shape = PRESETS[setting.preset]
    n = parameters(shape, setting.vocab_size)
    rows = setting.micro_batch or setting.batch_size
    chunked = rows < setting.batch_size
    unit = 4 * rows * setting.seq_len  # bytes of one fp32 value per token of a chunk
    per_dim = unit * shape.d_model
    if setting.activation_checkpointing:  # the kept inputs, and the larger of the loss's copies and one block
        kept = int(shape.n_layers * constants.kept * per_dim)
        activations = kept + int(constants.block * per_dim)
        logits = max(0, int(constants.logits * unit * setting.vocab_size) - int(constants.block * per_dim))
    else:
        activations = int(shape.n_layers * constants.block * per_dim)
        logits = int(constants.logits * unit * setting.vocab_size)
    # AdamW's two moments: fp32, or 8 bits with a scale per 256 values; the 8-bit step works on one parameter at a
    # time in fp32 (the parameter, its gradient and both moments dequantized)
    eight_bit = setting.optimizer == "adamw8bit"
    moments = 2 * (1 + 4 / 256) if eight_bit else 8
    largest = max(setting.vocab_size * shape.d_model, shape.d_model * shape.d_ff)
    step = (8 + moments) * n + (16 * largest if eight_bit else constants.step_temporaries * n)
    return Estimate(weights_and_optimizer=int((8 if chunked else 4) * n + moments * n),
                    weight_cache=constants.weight_cache * n, activations=activations, logits=logits,
                    outer_state=outer_state_bytes(setting), step=int(step))


def outer_state_bytes(setting: Setting) -> int:
    """Device bytes of the device path's copies of ``G, v`` (two fp32 vectors per element copied)."""
    if setting.state_on_device == "rolling":
        shape = PRESETS[setting.preset]
        return 8 * setting.rolling_copies * largest_fragment(shape, setting.vocab_size, setting.fragment_blocks)
    return 8 * parameters(PRESETS[setting.preset], setting.vocab_size) if setting.state_on_device else 0


def ways_to_fit(base: Setting, budget: int, constants: Constants = CUDA) -> Iterator[tuple[Setting, Estimate]]:
    """The settings of ``base``'s preset and batch that fit ``budget`` bytes, the fastest kind first (torch's AdamW
    before the 8-bit one, whole batches before micro-batches, the largest micro-batch first, checkpointing only where
    needed; the device path with every fragment's copy, then its rolling residency, then the host path)."""
    micro = [0] + [m for m in (8, 4, 2, 1) if m < base.batch_size and base.batch_size % m == 0]
    for optimizer in dict.fromkeys((base.optimizer, "adamw8bit")):
        for m in micro:
            for checkpointing in (False, True):
                for on_device in (True, "rolling", False):
                    option = dataclasses.replace(base, micro_batch=m, activation_checkpointing=checkpointing,
                                                 state_on_device=on_device, optimizer=optimizer)
                    if (guess := estimate(option, constants)).total <= budget:
                        yield option, guess
