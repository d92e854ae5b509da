"""Take the model home: the swarm's shared model out of a run dir, as files that load without swarmloco.

A run dir's newest checkpoint holds the resolved config, the local weights ``theta`` and, per fragment, the
swarm's shared outer parameters ``G`` (bit-identical on every peer that applied the same rounds). ``shared``
weights (the default) are the model with each fragment set to its ``G``; ``local`` ones are this peer's ``theta``.

:func:`export` writes
- built-in models: ``model.safetensors`` (tied tensors once), ``config.json`` and ``modeling.py`` (a copy of
  :mod:`peer.local.model`, torch only), so that ``modeling.Transformer(modeling.ModelShape(**cfg["shape"]), ...)``
  loads the weights in plain PyTorch;
- Hugging Face models: a ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained`` loads;
plus the tokenizer files when the run trained on prepared data, and ``swarmloco.json``: where the weights came
from (:func:`provenance`: run hash, step, per-fragment round and digest).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from peer.config import PeerConfig
from peer.errors import SetupError
from peer.local import model as model_module
from peer.local.model import build_model
from peer.outer.fragments import partition
from peer.outer.state import digest_of
from peer.run import checkpoint

__all__ = ["SavedRun", "load_run", "run_model", "export", "generate", "TextCodec", "text_codec"]

WEIGHTS = ("shared", "local")


@dataclass
class SavedRun:
    """What a run dir's newest good checkpoint holds, read back."""

    cfg: PeerConfig
    path: Path
    step: int
    payload: dict[str, Any]


def load_run(run_dir: str | Path) -> SavedRun:
    """The newest checkpoint of ``run_dir`` that verifies; :class:`SetupError` (one line) when there is none."""
    folder = Path(run_dir) / "checkpoints"
    if not Path(run_dir).is_dir():
        raise SetupError(f"--run-dir {run_dir}: no such directory")
    found = checkpoint.load_latest(folder)
    if found is None:
        raise SetupError(f"--run-dir {run_dir}: no usable checkpoint in {folder} (has the peer written one? "
                         "see run.checkpoint_minutes)")
    path, payload = found
    if not isinstance(payload.get("config"), dict) or "engine" not in payload or "model" not in payload:
        raise SetupError(f"{path}: a checkpoint without its config, model or outer state (written by an older "
                         "swarmloco?)")
    return SavedRun(PeerConfig.from_dict(payload["config"]), path, int(payload["step"]), payload)


def run_model(run: SavedRun, weights: str = "shared") -> nn.Module:
    """The run's model on the CPU in eval mode, with the ``weights`` of :data:`WEIGHTS` (see the module
    docstring). One-line :class:`SetupError` when the checkpoint does not fit the model its config builds."""
    if weights not in WEIGHTS:
        raise SetupError(f"--weights {weights!r}: choose shared or local")
    cfg = run.cfg
    try:
        model, blocks = build_model(cfg.model.preset, cfg.data.vocab_size, cfg.model.seq_len,
                                    cfg.model.factory or None, hf_config=cfg.model.hf_config,
                                    hf_blocks=cfg.model.hf_blocks)
        model.load_state_dict(run.payload["model"])
    except (ValueError, RuntimeError) as e:  # an HF config no longer there, a state dict of another shape
        raise SetupError(f"{run.path}: cannot rebuild its model ({str(e).splitlines()[0]})") from None
    if weights == "shared":
        fragments = partition(model, blocks, cfg.outer.fragment_blocks, cfg.outer.fragment_pattern)
        saved = run.payload["engine"]["fragments"]
        if len(saved) != len(fragments):
            raise SetupError(f"{run.path}: {len(saved)} fragments saved, the model has {len(fragments)}")
        for fragment, state in zip(fragments, saved):
            fragment.assign(state["G"])
    return model.eval()


def provenance(run: SavedRun, weights: str) -> dict[str, Any]:
    """Where exported weights came from: the run, the step, and per fragment its round and digest."""
    fragments = [{"fragment": i, "round": int(st["round"]), "digest": digest_of(st["G"], st["v"])}
                 for i, st in enumerate(run.payload["engine"]["fragments"])]
    return {"format": 1, "run_hash": run.payload.get("run_hash"), "run_id": run.cfg.swarm.run_id,
            "checkpoint": run.path.name, "step": run.step, "weights": weights, "fragments": fragments}


def _tokenizer_file(cfg: PeerConfig) -> Optional[Path]:
    """The ``tokenizer.json`` of the run's prepared data (next to its manifest), if the run used one and it
    is still there."""
    manifest = cfg.content_files().get("data.manifest")
    if manifest is None:
        return None
    file = manifest.parent / "tokenizer.json"
    return file if file.is_file() else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def export(run: SavedRun, out: str | Path, *, weights: str = "shared", force: bool = False) -> list[Path]:
    """Writes the run's model into ``out`` (see the module docstring); returns the files written. ``out`` must
    be empty or absent unless ``force``. The files are written into a temporary sibling directory that
    replaces ``out`` at the end, so an interrupted export leaves no half-written model behind."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise SetupError(f"--out {out} is not an empty directory: choose another one or pass --force")
    cfg = run.cfg
    shape = model_module.PRESETS.get(cfg.model.preset)
    if not cfg.model.hf_config and (cfg.model.factory or shape is None):
        raise SetupError(f"{run.path}: a factory model ({cfg.model.factory}) has no portable definition; export "
                         "writes built-in presets and Hugging Face models")
    model = run_model(run, weights)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    hf = getattr(model, "hf", None)
    tokenizer = _tokenizer_file(cfg)
    if hf is not None:
        hf.save_pretrained(staging)  # config.json + model.safetensors
        if tokenizer is not None:
            _save_hf_tokenizer(tokenizer, staging)
    else:
        from safetensors.torch import save_model

        save_model(model, str(staging / "model.safetensors"))  # tied tensors once (save_file would refuse)
        assert shape is not None
        _write_json(staging / "config.json", {
            "architecture": "swarmloco.Transformer", "preset": cfg.model.preset,
            "shape": {k: getattr(shape, k) for k in ("n_layers", "d_model", "n_heads", "d_ff")},
            "vocab_size": cfg.data.vocab_size, "max_seq_len": cfg.model.seq_len,
            "tokenizer": "tokenizer.json" if tokenizer is not None else "bytes (utf-8, vocab 256)"})
        shutil.copyfile(model_module.__file__, staging / "modeling.py")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
    _write_json(staging / "swarmloco.json", provenance(run, weights))
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _save_hf_tokenizer(tokenizer: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
    fast.save_pretrained(out)


class TextCodec:
    """Text to token ids and back, for ``sample``: the run's tokenizer, or bytes for a vocabulary of 256."""

    def __init__(self, encode, decode, name: str):
        self.encode, self.decode, self.name = encode, decode, name


def text_codec(cfg: PeerConfig, tokenizer: str = "") -> TextCodec:
    """The run's text codec: ``tokenizer`` (a ``tokenizer.json``) if given, else the prepared data's tokenizer,
    else bytes when the vocabulary is 256 (text and synthetic runs). One-line :class:`SetupError` otherwise."""
    file = Path(tokenizer) if tokenizer else _tokenizer_file(cfg)
    if file is not None:
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # a missing package, file or format
            raise SetupError(f"tokenizer {file}: cannot load ({str(e).splitlines()[0]})") from None
        return TextCodec(lambda text: tok.encode(text).ids, lambda ids: tok.decode(ids), str(file))
    if cfg.data.vocab_size == 256:
        from peer.local.data import byte_decode, byte_encode

        return TextCodec(byte_encode, byte_decode, "bytes")
    raise SetupError(f"the run's vocabulary ({cfg.data.vocab_size}) is not bytes and its prepared data's "
                     "tokenizer.json is not where the run left it: pass --tokenizer FILE")


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], *, new_tokens: int, max_seq_len: int, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> list[int]:
    """Samples ``new_tokens`` tokens after ``prompt`` (the last ``max_seq_len`` tokens as context; no KV cache:
    a sample is short and this stays model-agnostic). ``temperature`` 0 is greedy."""
    if not prompt:
        raise SetupError("--prompt encodes to no tokens: give some text")
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(new_tokens):
        context = torch.tensor([ids[-max_seq_len:]], dtype=torch.long)
        logits = model(context)[0, -1].float()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        if 0 < top_k < logits.numel():
            cutoff = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return ids[len(prompt):]
