"""Typed, validated configuration of a peer: one ``kw_only`` dataclass per section (:mod:`peer.config.sections`;
the ``swarm`` section's in :mod:`peer.config.network`), every field with its default, its help and whether it is
local (:func:`~peer.config.fields.setting`). Where the values come from (TOML, ``SWARM_*`` env vars, flags):
:mod:`peer.config.load`. Any invalid value raises :class:`ConfigError` with one line naming the key and what is
allowed; the CLI turns it into exit status 2.

The *run hash* (:meth:`PeerConfig.run_hash`) covers every setting that changes the shared
computation (model, outer optimizer, schedule, codec, inner hyper-parameters, vocabulary, run id);
it is part of every DHT key and matchmaking key, so peers with different run configs never group.
Local choices (network addresses, run dir, device, batch size, data files, tau, ...) are not in it: each field
says so itself (``setting(..., local=True)``), next to its help text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config.fields import (CODEC_NAMES, MAX_MBPS, MBIT, MIN_MBPS, ConfigError, default_of, parse_active_hours,
                                setting, valid_mbps)
from peer.config.network import SwarmConfig
from peer.config.sections import DataConfig, InnerConfig, LimitsConfig, ModelConfig, OuterConfig, RunConfig

__all__ = ["CODEC_NAMES", "MAX_MBPS", "MBIT", "MIN_MBPS", "ConfigError", "default_of", "parse_active_hours", "setting",
           "valid_mbps", "DataConfig", "InnerConfig", "LimitsConfig", "ModelConfig", "OuterConfig", "RunConfig",
           "SwarmConfig", "SECTIONS", "PeerConfig", "content_digest", "iter_settings", "iter_fields"]

SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "inner": InnerConfig, "outer": OuterConfig,
    "swarm": SwarmConfig, "run": RunConfig, "limits": LimitsConfig,
}


@dataclass(kw_only=True)
class PeerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    run: RunConfig = field(default_factory=RunConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> "PeerConfig":
        """The config :meth:`to_dict` returned (e.g. the one a checkpoint stores), validated again. Keys this
        version does not know are dropped and missing ones take their defaults, so a run dir written by
        another version still describes its run."""
        sections = {}
        for name, section_cls in SECTIONS.items():
            known = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: v for k, v in values.get(name, {}).items() if k in known})
        return cls(**sections)

    def run_hash(self) -> str:
        """Hex digest (16 chars) of every setting that must agree across the peers of one run (the fields not
        marked ``local``)."""
        local = {(section, f.name) for section, f in iter_settings() if f.metadata["local"]}
        shared = {sec: {k: v for k, v in vals.items() if (sec, k) not in local}
                  for sec, vals in self.to_dict().items()}
        shared = {sec: vals for sec, vals in shared.items() if vals}  # (a section of local choices only: no trace)
        if files := self.content_files():  # (absent otherwise: runs without such files keep their hash)
            shared["content"] = {name: content_digest(path) for name, path in files.items()}
        blob = json.dumps(shared, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def content_files(self) -> dict[str, Path]:
        """Files whose *content* every peer of a run must share, by the setting that names them: the Hugging Face
        model config (``model.hf_config``) and the prepared data's manifest (``data.source = "tokens"``). Their
        paths are local (each peer keeps its copy where it likes); :meth:`run_hash` covers their content."""
        out: dict[str, Path] = {}
        hf_config = getattr(self.model, "hf_config", "")
        if hf_config:
            path = Path(hf_config)
            out["model.hf_config"] = path / "config.json" if path.is_dir() else path
        if self.data.source == "tokens" and self.data.paths:
            path = Path(self.data.paths[0])
            out["data.manifest"] = path / "manifest.json" if path.is_dir() else path
        return out

    @property
    def identity_path(self) -> Path:
        return Path(self.swarm.identity_path or Path(self.run.run_dir) / "identity.key")

    @property
    def pass_path(self) -> Path:
        return Path(self.swarm.pass_path or Path(self.run.run_dir) / "pass.txt")


def content_digest(path: Path) -> str:
    """sha256 of a JSON file's canonical form (key order and whitespace do not matter), or of its bytes when it is
    not JSON; a file that cannot be read raises :class:`ConfigError` naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        pass
    return hashlib.sha256(data).hexdigest()


def iter_settings():
    """Yields (section, dataclasses.Field) for every config field (``metadata``: ``help``, ``local``)."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def iter_fields():
    """Yields (section, field_name, python_type) for every config field."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, hints[f.name]
