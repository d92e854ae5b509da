"""The files ``data.paths`` names, checked without torch or numpy: ``swarm-peer run`` checks them before its heavy
imports, so a wrong path is one line within a second, and the data sources check them again when they open them.

Each check raises ``ValueError`` with one line naming the file or option to fix.
"""

from __future__ import annotations

import os

from peer.local.manifest import read_manifest

SOURCES = ("synthetic", "text", "bin", "tokens")


def _check_data_file(path: str) -> None:
    """``path`` is a readable, non-empty regular file (a text or bin source's input)."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path} is a directory; list the files in it in data.paths")
    if not os.path.isfile(path):
        raise ValueError(f"data file not found: {path}")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"cannot read data file {path}: {e.strerror or e}") from None
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file is empty: {path}")


def check_data_paths(kind: str, paths: list[str]) -> None:
    """``paths`` suit a source of ``kind``: none for synthetic; readable files for text and bin; for tokens, one
    path whose manifest reads (its shards are checked when the source opens them)."""
    if kind not in SOURCES:
        raise ValueError(f"unknown data.source {kind!r}; choose 'synthetic', 'text', 'bin' or 'tokens'")
    if kind == "synthetic":
        if paths:
            raise ValueError("data.source = 'synthetic' takes no data.paths; remove them or use 'text'/'bin'")
        return
    if not paths:
        raise ValueError(f"data.source = {kind!r} needs at least one path in data.paths")
    if kind == "tokens":
        if len(paths) != 1:
            raise ValueError(f"data.source = 'tokens' takes one path in data.paths (the directory swarm-peer "
                             f"prepare-data wrote, or its manifest.json), got {len(paths)}")
        read_manifest(paths[0])
        return
    for path in paths:
        _check_data_file(path)
