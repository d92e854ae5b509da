"""Where a peer's configuration comes from: the ``--config`` TOML file, ``SWARM_*`` environment variables and
command-line flags, merged in that order over the defaults of :mod:`peer.config` and validated
(:func:`build_config`). Every problem is a :class:`~peer.config.ConfigError` of one line naming the key.

Every field of every section has exactly one flag and one env-var twin:

- sections ``run`` and ``swarm`` use bare names: ``swarm.initial_peers`` -> ``--initial-peers``,
  ``SWARM_INITIAL_PEERS``;
- the other sections are prefixed: ``outer.lr`` -> ``--outer-lr``, ``SWARM_OUTER_LR``.

List values are repeatable flags, or space/comma-separated in env vars."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from peer.config import SECTIONS, ConfigError, PeerConfig, iter_fields

BARE_SECTIONS = ("run", "swarm")  # their flags carry no section prefix


def unknown_env(environ: dict[str, str]) -> list[str]:
    """One warning per ``SWARM_*`` variable of ``environ`` that matches no config key, naming the nearest key.

    Such a variable is ignored; it is usually a typo (``SWARM_OUTER_LRR``) or a key of another version.
    """
    import difflib

    known = {env_name(section, key) for section, key, _ in iter_fields()}
    out = []
    for name in sorted(environ):
        if name.startswith("SWARM_") and name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else "; see swarm-peer run --help for the keys"
            out.append(f"environment variable {name} matches no config key and is ignored{hint}")
    return out


def flag_name(section: str, key: str) -> str:
    """``--initial-peers`` for swarm.initial_peers, ``--outer-lr`` for outer.lr."""
    name = key if section in BARE_SECTIONS else f"{section}_{key}"
    return "--" + name.replace("_", "-")


def env_name(section: str, key: str) -> str:
    return "SWARM_" + flag_name(section, key)[2:].replace("-", "_").upper()


def parse_scalar(section: str, key: str, typ: Any, raw: str) -> Any:
    """Converts a string from a flag or env var to the field's type (ConfigError names the key)."""
    where = f"{section}.{key}"
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if typ == int | str:
            return int(raw) if raw.strip().lstrip("-").isdigit() else raw.strip()
        if typ == float | str:
            try:
                return float(raw)
            except ValueError:
                return raw.strip()  # (a name: the section's check says which it takes)
        if typ == list[str]:
            return [item for item in raw.replace(",", " ").split() if item]
        return raw
    except ValueError:
        raise ConfigError(f"{where}: expected {getattr(typ, '__name__', typ)} (got {raw!r})") from None


def _coerce_toml(section: str, key: str, typ: Any, value: Any, source: str) -> Any:
    where = f"{section}.{key}"
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ == int | str:
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} in {source}: expected an integer or a name (got {value!r})")
    if typ == float | str:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value) if isinstance(value, int) else value
        raise ConfigError(f"{where} in {source}: expected a number or a name (got {value!r})")
    if typ == list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ConfigError(f"{where} in {source}: expected a list of strings (got {value!r})")
    if typ is str and isinstance(value, bool):  # (a switch written as true / false: inner.compile was a bool)
        return "on" if value else "off"
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{where} in {source}: expected {typ.__name__} (got {value!r})")
    return value


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Reads a config file into {section: {key: value}}; unknown sections/keys are errors."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    types = {(s, k): t for s, k, t in iter_fields()}
    out: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"unknown section [{section}] in {path}; allowed: {', '.join(SECTIONS)}")
        for key, value in table.items():
            if (section, key) not in types:
                allowed = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
                raise ConfigError(f"unknown key '{section}.{key}' in {path}; allowed in [{section}]: {allowed}")
            out.setdefault(section, {})[key] = _coerce_toml(section, key, types[(section, key)], value, str(path))
    return out


def build_config(toml_path: str | None, overrides: dict[tuple[str, str], Any],
                 environ: dict[str, str] | None = None) -> PeerConfig:
    """Merges defaults < TOML < env < ``overrides`` (parsed flags, keyed by (section, key)) and validates."""
    env: dict[str, str] = dict(os.environ) if environ is None else environ
    values: dict[str, dict[str, Any]] = load_toml(toml_path) if toml_path else {}
    for section, key, typ in iter_fields():
        name = env_name(section, key)
        if name in env:
            values.setdefault(section, {})[key] = parse_scalar(section, key, typ, env[name])
    for (section, key), value in overrides.items():
        values.setdefault(section, {})[key] = value
    try:
        sections = {name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()}
    except TypeError as e:  # a programming error in overrides, not user input
        raise ConfigError(str(e)) from None
    cfg = PeerConfig(**sections)
    # A round's future completes within this; the engine must not give up on it earlier.
    patience = cfg.swarm.matchmaking_patience if cfg.outer.schedule == "steps" else 0.0
    rounds_take = cfg.swarm.matchmaking_timeout + patience + cfg.swarm.allreduce_timeout + cfg.swarm.witness_timeout
    if cfg.outer.wait_timeout <= rounds_take:
        what = "swarm.matchmaking_timeout + " + ("swarm.matchmaking_patience + " if patience else "")
        raise ConfigError(f"outer.wait_timeout: must be > {what}swarm.allreduce_timeout + 3 x swarm.dht_timeout "
                          f"({rounds_take:g}s) (got {cfg.outer.wait_timeout:g})")
    if not cfg.swarm.initial_peers and not cfg.swarm.new_swarm:
        raise ConfigError("--initial-peers is empty: pass the multiaddr printed by swarm-bootstrap "
                          "(is the variable you used unset?), or --new-swarm to start a new swarm")
    return cfg
