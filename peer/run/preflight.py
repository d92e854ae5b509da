"""Checks made before a peer joins the swarm, so that whatever a user can fix is reported in one line before any
other peer waits for this one: the identity and addresses, the device, the model's contract, the data, our pass.

Each raises :class:`~peer.errors.SetupError` (one line, exit status 2). Light to import (torch, the model and the
data sources are imported by the checks that use them): ``swarm-peer run`` calls :func:`check_data_files` before it
imports the trainer, so a wrong path is told within a second.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from peer.config import PeerConfig
from peer.errors import SetupError
from peer.local.inputs import check_data_paths

if TYPE_CHECKING:
    from peer.net.trust.auth import RunAccess

# The smallest batch that shows a model's output shape (a forward on the meta device costs nothing).
_PROBE_BATCH, _PROBE_LEN = 2, 8


def check_device(name: str) -> None:
    """``inner.device`` names a device this machine has. ``auto`` always passes (it falls back to the CPU).

    Uses NVML to count CUDA devices, which does not initialize CUDA in this process: the DHT process is
    forked after this check, and a fork after CUDA initialization is unsafe.
    """
    if not name.startswith("cuda"):
        return
    import torch

    if not torch.backends.cuda.is_built():
        raise SetupError(f"inner.device = {name}: this torch {torch.__version__} has no CUDA support; install a "
                         f"CUDA build of torch (see README, Docker: TORCH_INDEX_URL) or use --inner-device cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise SetupError(f"inner.device = {name}: no CUDA device is visible (NVIDIA driver missing, or "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); "
                         f"use --inner-device cpu or auto")
    index = int(name.partition(":")[2] or 0)
    if index >= count:
        raise SetupError(f"inner.device = {name}: only {count} CUDA device(s) visible (cuda:0 .. cuda:{count - 1})")


def _describe(out: Any) -> str:
    import torch

    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape)}"
    return f"a {type(out).__name__}"


def check_model(cfg: PeerConfig) -> int:
    """The model builds and its forward returns logits ``[batch, seq, vocab_size]`` for int64 tokens
    ``[batch, seq]``: built and run on the meta device (shapes only: no memory, no compute, no RNG). Returns its
    number of parameters.

    A factory whose model cannot run on the meta device (an op without a meta kernel) is only built here;
    its forward is then checked by the first training step.
    """
    import torch

    from peer.local.model import build_model

    where = (f"model.hf_config {cfg.model.hf_config!r}" if cfg.model.hf_config else
             f"model.factory {cfg.model.factory!r}" if cfg.model.factory else f"model.preset {cfg.model.preset!r}")
    try:
        with torch.device("meta"):  # an HF model too: from_config allocates nothing on meta
            model, _ = build_model(cfg.model.preset, cfg.data.vocab_size, cfg.model.seq_len,
                                   cfg.model.factory or None, hf_config=cfg.model.hf_config,
                                   hf_blocks=cfg.model.hf_blocks,
                                   activation_checkpointing=cfg.model.activation_checkpointing)
    except ValueError as e:
        raise SetupError(str(e)) from None
    except Exception as e:  # the user's factory raised while building
        raise SetupError(f"{where}: building the model failed: {type(e).__name__}: {e}") from None
    params = sum(p.numel() for p in model.parameters())
    length = min(_PROBE_LEN, cfg.model.seq_len)
    tokens = torch.zeros((_PROBE_BATCH, length), dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            out = model(tokens)
    except NotImplementedError:
        return params  # an op without a meta kernel: the first real step checks it
    except Exception as e:
        raise SetupError(f"{where}: forward(tokens [batch, seq]) failed: {type(e).__name__}: {e}") from None
    want = [_PROBE_BATCH, length, cfg.data.vocab_size]
    if not isinstance(out, torch.Tensor) or list(out.shape) != want:
        raise SetupError(f"{where}: forward(tokens [batch, seq]) must return logits [batch, seq, vocab_size] = "
                         f"{want}, got {_describe(out)} (see README: bring your own model)")
    return params


def check_data_files(cfg: PeerConfig) -> None:
    """The files ``data.paths`` names suit ``data.source`` (readable files; a prepared directory's manifest): the
    part of :func:`open_data` that needs no torch."""
    try:
        check_data_paths(cfg.data.source, cfg.data.paths)
    except ValueError as e:
        raise SetupError(f"data: {e}") from None


def open_data(cfg: PeerConfig, shard: int):
    """This peer's data source, checked: files readable, at least one sequence long, ids within the vocabulary
    (in the first window; every window is checked again as it is read). Prepared data (``tokens``) is checked
    against its manifest too: its version, its vocabulary against ``data.vocab_size``, every shard's size and
    sha256 (a full read of the shards; see ``TokenShardSource``)."""
    from peer.local.data import make_source

    try:
        source = make_source(cfg.data.source, paths=cfg.data.paths, vocab_size=cfg.data.vocab_size,
                             seed=cfg.data.seed, shard_index=shard, holdout=cfg.data.holdout)
        check = getattr(source, "check", None)
        if check is not None:
            check(cfg.model.seq_len)
    except (ValueError, OSError) as e:
        raise SetupError(f"data: {e}") from None
    return source


def load_access(cfg: PeerConfig) -> Optional["RunAccess"]:
    """Our pass in an authenticated run (``swarm.authority`` set), checked against the run's authority and our
    identity; None in an open run. Must be called after the identity exists."""
    if not cfg.swarm.authority:
        return None
    from peer.net.trust.auth import RunAccess

    try:
        return RunAccess.load(cfg.swarm.authority, cfg.pass_path, cfg.identity_path)
    except ValueError as e:
        raise SetupError(str(e)) from None


def describe_access(cfg: PeerConfig, access: Optional["RunAccess"]) -> str:
    """The log line that says who may take part in the run (``access``: :func:`load_access`'s)."""
    if access is None:
        bound = ("contributions are bounded by the clipped rule" if cfg.outer.aggregator == "clipped" else
                 "WARNING: outer.aggregator = mean trusts every contribution (use clipped in an open run)")
        return (f"open run: any peer may join and contribute (set swarm.authority to admit only peers with a "
                f"pass); {bound}")
    from peer.net.trust.auth import fingerprint

    return (f"authenticated run: only peers with a pass from authority {fingerprint(access.checker.authority_bytes)} "
            f"take part; our pass is valid until {access.token.expiration_time}")


def check_identity_and_addresses(cfg: PeerConfig) -> str:
    """Our peer id (the identity is created if missing), after checking the addresses the swarm section names
    (initial peers, listening and announced addresses, the relay options)."""
    from peer.net.plumbing.addresses import check_maddrs, ensure_identity
    from peer.net.plumbing.dht import relay_options

    try:
        peer_id = ensure_identity(cfg.identity_path)
    except (ValueError, OSError) as e:
        raise SetupError(f"--identity-path: {e}") from None
    try:
        check_maddrs(initial_peers=cfg.swarm.initial_peers, host_maddrs=cfg.swarm.host_maddrs,
                     announce_maddrs=cfg.swarm.announce_maddrs)
        relay_options(cfg.swarm.relay_via, relay_service=cfg.swarm.relay_service, client_mode=cfg.swarm.client_mode)
    except ValueError as e:
        raise SetupError(str(e)) from None
    return peer_id


def pass_request_line(cfg: PeerConfig) -> str:
    """The line a volunteer sends the operator of an authenticated run (``swarm-peer pass-request``): its peer id
    and identity key; the identity is created if missing."""
    from peer.net.trust.auth import identity_key, pass_request
    from peer.net.plumbing.addresses import ensure_identity

    try:
        ensure_identity(cfg.identity_path)
    except (ValueError, OSError) as e:
        raise SetupError(f"--identity-path: {e}") from None
    return pass_request(identity_key(cfg.identity_path))
