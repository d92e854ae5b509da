"""The peer's local half, built from its config: the device, the model with the run's initial weights, the GPU
memory cap and the inner loop (the trainer composes them with the swarm)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from peer.config import PeerConfig
from peer.control.limits import vram_fraction
from peer.local import memory
from peer.local.inner import InnerLoop, compile_wanted
from peer.local.model import build_model, count_parameters
from peer.outer.schedule import rolling_copies

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    """``inner.device``: ``auto`` is CUDA where there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_local(cfg: PeerConfig, source) -> tuple[nn.Module, list[nn.Module], InnerLoop]:
    """The model (``init_seed``: the same theta_0 on every peer), its blocks and the inner loop, on the configured
    device. Must be called after the swarm's DHT process forked (it may initialize CUDA)."""
    if cfg.inner.threads:
        torch.set_num_threads(cfg.inner.threads)
    device = pick_device(cfg.inner.device)
    torch.manual_seed(cfg.model.init_seed)  # identical theta_0 on every peer of the run
    model, blocks = build_model(cfg.model.preset, cfg.data.vocab_size, cfg.model.seq_len,
                                cfg.model.factory or None, hf_config=cfg.model.hf_config,
                                hf_blocks=cfg.model.hf_blocks,
                                activation_checkpointing=cfg.model.activation_checkpointing)
    cap_vram(cfg.limits.vram_gb, device)
    model.to(device)
    compiled = compile_wanted(cfg.inner.compile, device)
    inner = InnerLoop(model, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                      betas=(cfg.inner.beta1, cfg.inner.beta2), warmup_steps=cfg.inner.warmup_steps,
                      total_steps=cfg.inner.total_steps, min_lr_ratio=cfg.inner.min_lr_ratio,
                      grad_clip=cfg.inner.grad_clip, z_loss=cfg.inner.z_loss, device=device,
                      micro_batch=cfg.data.micro_batch, compile=compiled, optimizer=cfg.inner.optimizer)
    log.info("model %s: %s parameters on %s%s; data %s shard %d",
             cfg.model.hf_config or cfg.model.factory or cfg.model.preset, f"{count_parameters(model):,}", device,
             f" (torch.compile, inner.compile = {cfg.inner.compile}: the first steps compile)" if compiled else "",
             cfg.data.source,
             source.shard_index)
    return model, blocks, inner


def cap_vram(vram_gb: float, device: torch.device) -> None:
    """``limits.vram_gb``: caps this process's share of the GPU before anything is allocated on it."""
    cap = vram_gb * 2 ** 30
    if not cap:
        return
    if device.type != "cuda":
        log.info("limits.vram_gb = %g: no effect on %s", vram_gb, device)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = vram_fraction(cap, total)
    if fraction is None:
        log.info("limits.vram_gb = %g: the device has %.1f GiB, the cap does not bind", vram_gb, total / 2 ** 30)
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("GPU memory capped at %.1f GiB of %.1f GiB (limits.vram_gb)", cap / 2 ** 30, total / 2 ** 30)


def memory_setting(cfg: PeerConfig, *, state_on_device: "bool | str" = False) -> memory.Setting:
    """The memory model's view of a peer's config (its model a preset), ``state_on_device`` as resolved: the copies
    a rolling residency holds are planned for the longest overlap (``tau``, or ``tau_max`` with ``tau = auto``)."""
    m, o = cfg.model, cfg.outer
    layers = memory.PRESETS[m.preset].n_layers
    blocks = o.fragment_blocks if 0 < o.fragment_blocks < layers else layers
    tau = o.tau if isinstance(o.tau, int) else min(o.sync_every - 1, o.tau_max)
    return memory.Setting(preset=m.preset, vocab_size=cfg.data.vocab_size, seq_len=m.seq_len,
                          batch_size=cfg.data.batch_size, micro_batch=cfg.data.micro_batch,
                          activation_checkpointing=m.activation_checkpointing, state_on_device=state_on_device,
                          optimizer=cfg.inner.optimizer, fragment_blocks=blocks,
                          rolling_copies=rolling_copies(tau, o.sync_every, -(-layers // blocks)))


def outer_state_reserve(cfg: PeerConfig, device: torch.device) -> int:
    """Device bytes the outer state's copies must leave free beyond what is free now (``outer.state_on_device =
    auto``, peer/outer/device_state.py): what the inner step will still allocate (the memory model's peak less
    what is allocated now, for a preset model; its optimizer moments and activations come at the first step), and
    what the owner's cap (``limits.vram_gb``) keeps of the free memory. 0 off CUDA. Must be called after
    :func:`build_local`."""
    if device.type != "cuda":
        return 0
    reserve = 0
    if not (cfg.model.factory or cfg.model.hf_config) and cfg.model.preset in memory.PRESETS:
        peak = memory.estimate(memory_setting(cfg), memory.CUDA).total
        reserve = max(0, peak - torch.cuda.memory_allocated(device))
    if cfg.limits.vram_gb > 0:
        capped = int(cfg.limits.vram_gb * 2 ** 30) - torch.cuda.memory_reserved(device)
        reserve += max(0, torch.cuda.mem_get_info(device)[0] - capped)
    return reserve
