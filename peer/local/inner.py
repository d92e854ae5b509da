"""The inner loop of one peer: AdamW steps on local data with a warmup+cosine LR.

This is DiLoCo's InnerOpt (Streaming DiLoCo Alg. 2 lines 3-5). The outer machinery
overwrites parameter values between inner steps (fragment merges); the optimizer
state and the LR-schedule position survive that, and both are checkpointed through
``InnerLoop.state_dict``.

Weight decay: applied to matrices only. Excluded are every parameter with fewer than
2 dimensions (norm gains, biases) and the weights of every ``nn.Embedding`` (in our
model the token embedding is also the tied LM head; decaying it would shrink the
output logits too). The rule is structural, so it also works for factory models.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from peer.local.model import lm_loss

__all__ = ["lr_at", "split_decay_params", "StepStats", "InnerLoop", "OPTIMIZERS"]
OPTIMIZERS = ("adamw", "adamw8bit")  # the inner optimizer's choices (inner.optimizer)


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for 0-based inner step ``step`` (the step about to be taken).

    Linear warmup ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (so the
    first step already moves), then cosine decay from ``lr`` at ``step == warmup_steps``
    to ``lr * min_lr_ratio`` at ``step == total_steps``, constant after. Raises
    ``ValueError`` for negative sizes, ``warmup_steps > total_steps`` or a ratio outside [0, 1].
    """
    if lr < 0 or warmup_steps < 0 or total_steps < 0 or step < 0:
        raise ValueError(
            f"lr, warmup_steps, total_steps and step must be >= 0 (got {lr}, {warmup_steps}, {total_steps}, {step})"
        )
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps == 0 else min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split the unique trainable parameters into ``(decay, no_decay)``.

    ``no_decay``: parameters with ``ndim < 2`` and weights of ``nn.Embedding`` modules.
    Shared (tied) tensors appear once; order follows ``model.named_parameters``.
    """
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():  # de-duplicates tied tensors
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_ids else decay).append(p)
    return decay, no_decay


class StepStats:
    """What one inner step measured. ``lr`` and ``tokens`` (target tokens, B * T) are plain numbers; ``loss``
    (includes the z-loss), ``ce`` (nats) and ``grad_norm`` (global L2 norm before clipping) stay on the device
    until one of them is read: the first read waits for the device once for all three (the training thread
    never waits otherwise), and raises ``FloatingPointError`` if this step or an earlier one of its loop was
    not finite (see :class:`InnerLoop`)."""

    def __init__(self, *, lr: float, tokens: int, measured: Tensor, first_bad: Optional[Tensor] = None) -> None:
        self.lr, self.tokens = lr, tokens
        self._measured = measured.detach()  # [loss, ce, grad_norm]
        self._first_bad = first_bad  # [step, loss, grad_norm] of the loop's first non-finite step (step -1: none)
        self._values: Optional[list[float]] = None

    def resolve(self) -> "StepStats":
        """Reads the values from the device (once); raises ``FloatingPointError`` as the class docstring says."""
        if self._values is None:
            both = self._measured if self._first_bad is None else torch.cat([self._measured, self._first_bad])
            values = both.tolist()  # the one wait for the device
            if len(values) > 3 and values[3] >= 0:
                raise FloatingPointError(non_finite_message(int(values[3]), values[4], values[5]))
            self._values = values[:3]
        return self

    @property
    def loss(self) -> float:
        return self._value(0)

    @property
    def ce(self) -> float:
        return self._value(1)

    @property
    def grad_norm(self) -> float:
        return self._value(2)

    def _value(self, i: int) -> float:
        values = self.resolve()._values
        assert values is not None
        return values[i]


def non_finite_message(step: int, loss: float, grad_norm: float) -> str:
    """The one line a non-finite step raises with (the loss first: a non-finite loss makes the norm so too)."""
    if not math.isfinite(loss):
        return f"inner step {step}: loss is {loss}; lower the lr or check the data/model"
    return f"inner step {step}: gradient norm is {grad_norm}; lower the lr"


@torch.no_grad()
def mean_ce(model: nn.Module, batch: Tensor, *, params: Optional[dict[str, Tensor]] = None, chunk: int = 0,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` (in eval mode; left so) on ``batch`` (int64
    ``[B, T + 1]``, moved to the model's device), with ``params`` ({name: tensor on the model's device}) in place
    of its own parameters where given (``torch.func.functional_call``: the model is untouched), ``chunk``
    sequences at a time (0: all at once)."""
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be [B, T+1] with T >= 1, got shape {tuple(batch.shape)}")
    device = next(model.parameters()).device
    batch = batch.to(device)
    model.eval()
    total = torch.zeros((), device=device)
    for part in batch.split(chunk or batch.shape[0]):
        with autocast():
            logits = torch.func.functional_call(model, params or {}, (part[:, :-1],))
        total += lm_loss(logits, part[:, 1:], 0.0)[1] * part.shape[0]
    return float(total) / batch.shape[0]


TRITON_MIN_CAPABILITY = (7, 0)  # Triton builds no kernels for older cards (Pascal and before)


def compile_wanted(choice: str, device: torch.device) -> bool:
    """``inner.compile``: ``on``, ``off``, or ``auto``: on a CUDA device that Triton (inductor's GPU kernels) is
    installed for and supports. On an H100, compiling made the 100M preset's steps 1.9x faster and the peer's
    overhead over a plain loop 4% instead of 17% (docs/benchmarks.md, 2026-11-28); on the CPU it needs a C++
    compiler and gains little."""
    if choice != "auto":
        return choice == "on"
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None and \
        torch.cuda.get_device_capability(device) >= TRITON_MIN_CAPABILITY


class InnerLoop:
    """AdamW inner optimizer with schedule, clipping and bf16 autocast on CUDA.

    ``step(batch)`` takes int64 ``[B, T + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``),
    moves it to ``device``, and does one forward/backward/AdamW update with the LR
    ``lr_at(step_count, ...)``. The model must already be on ``device``. ``step_count`` counts completed
    steps.

    A non-finite loss or gradient norm never reaches the parameters nor the optimizer state. With
    ``defer_checks`` off (the default on the CPU, where a wait is cheap) ``step`` raises ``FloatingPointError``
    at once, parameters untouched. With it on (the default on CUDA: no host synchronization per step) the
    check stays on the device: the fused AdamW skips the update (its ``found_inf``), and from that step on the
    loop is latched: every later update is skipped too, so the parameters stay as they were before the bad
    step, and reading the stats of that step or any later one raises the ``FloatingPointError`` naming the
    bad step (:meth:`check_finite` too). The caller must stop there, as after the eager raise.

    Gradient accumulation: with ``micro_batch`` > 0 the batch is cut into chunks of at most
    ``micro_batch`` sequences, each forward/backward on its own, the loss of each scaled by its
    share of the batch; the update is the one the whole batch gives (up to float summation
    order) while activations are held for one chunk at a time.

    ``compile``: the forward runs through ``torch.compile(model)``; the parameters are the model's own (the
    compiled wrapper shares them), so ``self.model``, its ``state_dict`` and the fragments keep their names.

    ``optimizer``: ``adamw`` (torch's), or ``adamw8bit``: torchao's AdamW with its moments in 8 bits (2 bytes per
    parameter instead of 8, for a card the model does not otherwise fit; its step is compiled on first use). It
    has no ``found_inf``, so its checks are never deferred: each step waits for the device to read the loss.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float,
        grad_clip: float,
        z_loss: float,
        device: torch.device,
        micro_batch: int = 0,
        defer_checks: Optional[bool] = None,
        compile: bool = False,
        optimizer: str = "adamw",
    ) -> None:
        lr_at(0, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)  # validate
        if grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables), got {grad_clip}")
        if micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0 (0: the whole batch at once), got {micro_batch}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        if optimizer == "adamw8bit" and defer_checks:
            raise ValueError("adamw8bit cannot skip a non-finite step on the device: defer_checks must be off")
        self.micro_batch = micro_batch
        self.model = model  # the module itself (checkpoints, fragments); forward_model may be its compiled wrapper
        self.forward_model: Callable[[Tensor], Tensor] = torch.compile(model) if compile else model
        self.device = torch.device(device)
        self.defer_checks = self.device.type == "cuda" and optimizer == "adamw" if defer_checks is None \
            else defer_checks
        self.lr, self.warmup_steps, self.total_steps = lr, warmup_steps, total_steps
        self.min_lr_ratio, self.grad_clip, self.z_loss = min_lr_ratio, grad_clip, z_loss
        decay, no_decay = split_decay_params(model)
        self.params = decay + no_decay
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # fused AdamW is the fast path on CUDA and the one that takes found_inf (deferred checks); the CPU
        # default (foreach) is what the exact-fp32 tests were written against.
        groups = [g for g in groups if g["params"]]
        if optimizer == "adamw8bit":
            from torchao.optim import AdamW8bit  # (imported only when chosen: it loads its kernels)

            self.optimizer: torch.optim.Optimizer = AdamW8bit(groups, lr=lr, betas=betas)
        else:
            fused = {"fused": True} if self.device.type == "cuda" or self.defer_checks else {}
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, **fused)
        self.step_count = 0
        self._first_bad = self._no_bad()

    def _no_bad(self) -> Tensor:
        """The latch of deferred checks: [step, loss, grad_norm] of the first non-finite step; step -1: none yet."""
        return torch.tensor([-1.0, 0.0, 0.0], device=self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # fp32 on CPU: CPU bf16 is slow and the tests want exact fp32

    def current_lr(self) -> float:
        """The LR the next ``step`` will use."""
        return lr_at(
            self.step_count, lr=self.lr, warmup_steps=self.warmup_steps,
            total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio,
        )

    def step(self, batch: Tensor) -> StepStats:
        """One inner update on ``batch``; see the class docstring for the contract."""
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(f"batch must be [B, T+1] with T >= 1, got shape {tuple(batch.shape)}")
        batch = batch.to(self.device, non_blocking=True)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows = batch.shape[0]
        size = self.micro_batch or rows
        loss_sum = torch.zeros((), device=self.device)
        ce_sum = torch.zeros((), device=self.device)
        for chunk in batch.split(size):
            with self._autocast():
                logits = self.forward_model(chunk[:, :-1])
            loss, ce = lm_loss(logits, chunk[:, 1:], self.z_loss)  # float32, outside autocast
            share = chunk.shape[0] / rows  # the chunks' mean losses, weighted by rows, give the batch's mean
            (loss * share).backward()
            del logits  # (frees this chunk's activations before the next forward)
            loss_sum += loss.detach() * share
            ce_sum += ce.detach() * share
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        measured = torch.stack([loss_sum, ce_sum, grad_norm.to(torch.float32)])
        if self.defer_checks:
            self._latch(measured)
        else:
            loss_value, _, norm_value = measured.tolist()  # a wait for the device: cheap on the CPU
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(non_finite_message(self.step_count, loss_value, norm_value))
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, grad_norm)
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], Tensor):  # (torchao keeps it as a tensor, so that its compiled step stays)
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.optimizer.step()
        self.step_count += 1
        return StepStats(lr=lr, tokens=rows * (batch.shape[1] - 1), measured=measured,
                         first_bad=self._first_bad if self.defer_checks else None)

    def evaluate(self, batch: Tensor, params: Optional[dict[str, Tensor]] = None) -> float:
        """:func:`mean_ce` of the model on ``batch``, with ``params`` in place of its own parameters where given, in
        chunks of ``micro_batch`` sequences under the training autocast (the optimizer and step count are
        untouched). Waits for the device."""
        try:
            return mean_ce(self.model, batch, params=params, chunk=self.micro_batch, autocast=self._autocast)
        finally:
            self.model.train()

    def _latch(self, measured: Tensor) -> None:
        """Deferred checks, all on the device: records this step in the latch if it is the first non-finite one,
        and sets the optimizer's ``found_inf`` (skip the update) while the latch is set."""
        bad_now = ~torch.isfinite(measured[0::2]).all()
        here = torch.cat([torch.full((1,), float(self.step_count), device=self.device), measured[0::2]])
        self._first_bad = torch.where(bad_now & (self._first_bad[0] < 0), here, self._first_bad)
        setattr(self.optimizer, "found_inf", (self._first_bad[0] >= 0).to(torch.float32))  # read by fused AdamW

    def check_finite(self) -> None:
        """Raises ``FloatingPointError`` if a step of this loop was not finite (a wait for the device with
        deferred checks; nothing to wait for otherwise, the step raised already)."""
        if self.defer_checks:
            step, loss, norm = self._first_bad.tolist()
            if step >= 0:
                raise FloatingPointError(non_finite_message(int(step), loss, norm))

    def state_dict(self) -> dict:
        """Optimizer state (tensors) and the schedule position; save with ``torch.save``."""
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (for the same model and parameter order); clears the latch."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        self._first_bad = self._no_bad()
