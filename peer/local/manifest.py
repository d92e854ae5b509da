"""The manifest of prepared data (``swarm-peer prepare-data``'s ``manifest.json``): its name, version and token
dtypes, and the reader that checks it. Light on purpose (no torch): the command line reads it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1  # bump when a reader of version 1 would misread the new layout
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # manifest name -> little-endian numpy dtype


def read_manifest(path: str | os.PathLike) -> tuple[Path, dict]:
    """``(manifest file, manifest)`` of prepared data: ``path`` is the directory ``swarm-peer prepare-data`` wrote
    or its ``manifest.json``. Raises ``ValueError`` (one line naming what to fix) when the file is missing, not
    JSON, of an unknown version or lacks a field the readers need; the shards themselves are not looked at."""
    file = Path(path)
    if file.is_dir():
        file = file / MANIFEST_NAME
    if not file.is_file():
        raise ValueError(f"{file} not found: data.paths names the directory that swarm-peer prepare-data "
                         f"INPUT... --out DIR wrote (or its manifest.json)")
    try:
        manifest = json.loads(file.read_bytes())
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e.strerror or e}") from None
    except ValueError:
        raise ValueError(f"{file} is not JSON: prepare the data again with swarm-peer prepare-data") from None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if version != MANIFEST_VERSION:
        raise ValueError(f"{file}: unknown manifest version {version!r} (this swarm-peer reads version "
                         f"{MANIFEST_VERSION}); prepare the data again with this swarm-peer, or upgrade it")
    try:
        ok = (manifest["dtype"] in TOKEN_DTYPES and int(manifest["vocab_size"]) > 0
              and all(_bare_name(sh["file"]) and int(sh["tokens"]) >= 0 and isinstance(sh["sha256"], str)
                      for sh in manifest["shards"]))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{file}: malformed manifest (dtype, vocab_size or shards); prepare the data again")
    return file, manifest


def _bare_name(name: object) -> bool:
    """A file name without a directory: a manifest's shards are read from its own directory only."""
    return isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
