"""Hugging Face causal LMs as a model source: a ``transformers`` model built from a local ``config.json``.

Contract of :func:`build_hf_model`:

- Built from the config alone (``AutoModelForCausalLM.from_config``), never downloaded, in float32; the weights
  come from the global torch RNG (the trainer seeds it with ``model.init_seed``: one ``theta_0`` for every peer).
- Returns ``(HFCausalLM, blocks)``: ``forward(tokens [B, T] int64)`` returns the logits ``[B, T, vocab_size]``;
  ``blocks`` are the model's transformer blocks in depth order (:func:`find_blocks`).
- Tied embeddings stay one ``Parameter``: counted once, in exactly one fragment.
- Whatever the user can fix raises ``ValueError`` with one line (preflight: exit status 2): an unreadable or
  unknown config, a vocab size other than ``data.vocab_size``, too long a ``model.seq_len``, no blocks found.
- Under ``torch.device("meta")`` it allocates nothing, and a forward returns meta logits (preflight's check).

``transformers`` is the ``hf`` extra: ``peer.local.model`` imports this module only when ``model.hf_config`` is set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BLOCK_PATHS", "HFCausalLM", "build_hf_model", "find_blocks", "read_hf_config"]

# Where the common families keep their block list (tried in this order): Llama/Qwen/Mistral/Gemma/Phi,
# GPT-2/GPT-J/Falcon/Bloom, GPT-NeoX/Pythia, OPT.
BLOCK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
# The config keys that bound the sequence length, by family (Llama: the first; GPT-2: the second; MPT: max_seq_len).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("model.hf_config needs the transformers package: pip install 'swarmloco[hf]'") from None
    return transformers


def read_hf_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(file, dict)`` of the ``config.json`` at ``path`` (the file, or a directory holding it); one-line
    ``ValueError`` naming ``model.hf_config`` when it cannot be read, is not a JSON object or has no
    ``model_type``."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"model.hf_config = {str(path)!r}: cannot read {file} ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"model.hf_config: {file} is not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"model.hf_config: {file} is not a Hugging Face model config (no \"model_type\" key)")
    return file, data


def _resolve(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_blocks(model: nn.Module, hf_blocks: str = "") -> list[nn.Module]:
    """The transformer blocks of a ``transformers`` model, in depth order: the module list at the dotted
    path ``hf_blocks`` (relative to ``model``), or else at the first of :data:`BLOCK_PATHS` that exists.
    One-line ``ValueError`` naming ``model.hf_blocks`` when there is none."""
    name = type(model).__name__
    if hf_blocks:
        found = _resolve(model, hf_blocks)
        if found is None:
            raise ValueError(f"model.hf_blocks = {hf_blocks!r}: {name} has no such attribute")
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(f"model.hf_blocks = {hf_blocks!r}: in {name} this is a {type(found).__name__}, "
                             "not a non-empty list of blocks (nn.ModuleList)")
        return list(found)
    for path in BLOCK_PATHS:
        found = _resolve(model, path)
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
            return list(found)
    raise ValueError(f"found no transformer blocks in {name} (looked for {', '.join(BLOCK_PATHS)}): set "
                     "model.hf_blocks to the dotted path of its block list, e.g. 'model.layers'")


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with the peer's model contract: ``forward(tokens)`` returns the logits
    tensor (``transformers`` returns an output object) and no KV cache is made (training only).

    ``hf`` is the ``transformers`` model (``hf.save_pretrained`` exports it); ``hf_config_dict`` is the
    config as read from ``config.json``.
    """

    def __init__(self, hf: nn.Module, hf_config_dict: dict[str, Any]) -> None:
        super().__init__()
        self.hf = hf
        self.hf_config_dict = dict(hf_config_dict)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.device.type == "meta":
            # transformers reads values of its masks (.item()), which meta tensors do not have; under
            # FakeTensorMode it knows it is being traced and skips those reads: shapes only, as on meta.
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True):
                return self.hf(input_ids=tokens, use_cache=False).logits
        return self.hf(input_ids=tokens, use_cache=False).logits


def build_hf_model(hf_config: str, vocab_size: int, max_seq_len: int, *, hf_blocks: str = "",
                   activation_checkpointing: bool = False) -> tuple[HFCausalLM, list[nn.Module]]:
    """Build the causal LM that ``hf_config`` (a ``config.json`` or its directory) describes; see the module
    docstring for the contract. ``vocab_size`` is ``data.vocab_size`` and ``max_seq_len`` is
    ``model.seq_len``: both are checked against the config. ``activation_checkpointing`` turns on
    ``transformers``' activation (gradient) checkpointing, non-reentrant, active in training mode only."""
    transformers = _transformers()
    file, data = read_hf_config(hf_config)
    model_type = data["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"model.hf_config: {file}: model_type {model_type!r} is unknown to transformers "
                         f"{transformers.__version__}")
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as e:  # a value the config class rejects
        raise ValueError(f"model.hf_config: {file}: {type(e).__name__}: {e}".splitlines()[0]) from None
    text = config.get_text_config()  # multimodal configs nest the language model's settings
    hf_vocab = getattr(text, "vocab_size", None)
    if hf_vocab != vocab_size:
        raise ValueError(f"model.hf_config: {file} has vocab_size {hf_vocab} but data.vocab_size is {vocab_size}: "
                         f"set data.vocab_size = {hf_vocab} (or vocab_size in {file.name} to {vocab_size})")
    for key in _POSITION_KEYS:
        limit = getattr(text, key, None)
        if isinstance(limit, int):
            key = getattr(text, "attribute_map", {}).get(key, key)  # the name in the file (GPT-2: n_positions)
            if max_seq_len > limit:
                raise ValueError(f"model.seq_len = {max_seq_len} exceeds {key} = {limit} of model.hf_config "
                                 f"{file}: lower model.seq_len or raise {key}")
            break
    try:
        # float32 master weights whatever the config's dtype; no download: from_config only
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:  # a model type without a causal-LM head
        raise ValueError(f"model.hf_config: {file}: model_type {model_type!r} has no causal LM in transformers "
                         f"({str(e).splitlines()[0][:120]})") from None
    blocks = find_blocks(hf, hf_blocks)
    if activation_checkpointing:
        if not getattr(hf, "supports_gradient_checkpointing", False):
            raise ValueError(f"model.activation_checkpointing: {type(hf).__name__} does not support gradient "
                             "checkpointing; turn it off")
        kwargs = {"use_reentrant": False}  # works with autocast and with inputs that need no grad
        enable = getattr(hf, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:  # the older name (deprecated in 5.x)
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return HFCausalLM(hf, data), blocks
