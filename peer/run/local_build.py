"""The peer's local half, built from its config: the device, the model with the run's initial weights, the GPU
memory cap and the inner loop (the trainer composes them with the swarm)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from peer.config import PeerConfig
from peer.control.limits import vram_fraction
from peer.local.inner import InnerLoop
from peer.local.model import build_model, count_parameters

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
    inner = InnerLoop(model, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                      betas=(cfg.inner.beta1, cfg.inner.beta2), warmup_steps=cfg.inner.warmup_steps,
                      total_steps=cfg.inner.total_steps, min_lr_ratio=cfg.inner.min_lr_ratio,
                      grad_clip=cfg.inner.grad_clip, z_loss=cfg.inner.z_loss, device=device,
                      micro_batch=cfg.data.micro_batch, compile=cfg.inner.compile, optimizer=cfg.inner.optimizer)
    log.info("model %s: %s parameters on %s%s; data %s shard %d",
             cfg.model.hf_config or cfg.model.factory or cfg.model.preset, f"{count_parameters(model):,}", device,
             " (torch.compile: the first steps compile)" if cfg.inner.compile else "", cfg.data.source,
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
