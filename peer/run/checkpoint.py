"""Checkpoints of a peer: atomic, checksummed, the last K kept, never unpickled unverified.

File layout (``RUN_DIR/checkpoints/ckpt-<step>.swl``)::

    b"SWLCKPT1" | body length (8 bytes, little-endian) | sha256(body) (32 bytes) | body

``body`` is ``torch.save`` of a dict of tensors and plain values. :func:`load_latest` checks the
magic, length and checksum before it hands the body to ``torch.load(weights_only=True)`` (which
refuses arbitrary objects anyway); a truncated or corrupted file is reported in one line and the
previous good one is used. :func:`save` writes to a temporary file in the same folder, fsyncs,
renames and fsyncs the folder, so a crash at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Optional, cast

import torch

log = logging.getLogger(__name__)
MAGIC = b"SWLCKPT1"
HEADER = len(MAGIC) + 8 + 32
PATTERN = "ckpt-*.swl"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupted, wrong format)."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing(io.RawIOBase):
    """A write-only file for ``torch.save`` that hashes and counts what it passes on to ``f``, and keeps the
    ``OSError`` of a write that failed (``error``)."""

    def __init__(self, f):
        super().__init__()
        self.f, self.sha256, self.length = f, hashlib.sha256(), 0
        self.error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sha256.update(data)
        self.length += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise


def save(folder: str | Path, step: int, payload: dict[str, Any], keep: int = 3) -> Path:
    """Writes ``payload`` as checkpoint ``step`` atomically and deletes all but the newest ``keep``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"ckpt-{step:010d}.swl"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # The body streams to the file through the hash (no copy of it in memory); its header goes in last.
            f.write(bytes(HEADER))
            body = _Hashing(f)
            try:
                torch.save(payload, cast(IO[bytes], body))  # (torch only calls write)
            except Exception:
                # A failed write (a full disk) mostly comes out of torch as a RuntimeError of its archive
                # writer, raised while it closes the archive: the caller must see the OSError.
                if body.error is not None:
                    raise body.error from None
                raise
            f.seek(0)
            f.write(MAGIC + body.length.to_bytes(8, "little") + body.sha256.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(folder.glob(PATTERN))[:-keep]:
        old.unlink(missing_ok=True)
    return final


def read(path: str | Path) -> dict[str, Any]:
    """Verifies and loads one checkpoint file; raises :class:`CheckpointError` naming what is wrong."""
    data = Path(path).read_bytes()
    if len(data) < HEADER or data[:len(MAGIC)] != MAGIC:
        raise CheckpointError("not a swarmloco checkpoint (bad magic or shorter than its header)")
    length = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    body = data[HEADER:]
    if len(body) != length:
        raise CheckpointError(f"truncated: {len(body)} of {length} body bytes")
    if hashlib.sha256(body).digest() != data[len(MAGIC) + 8:HEADER]:
        raise CheckpointError("checksum mismatch (corrupted)")
    try:
        payload = torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")
    except Exception as e:  # verified bytes that still do not load: a format problem, not corruption
        raise CheckpointError(f"unreadable payload: {e}") from None
    if not isinstance(payload, dict):
        raise CheckpointError("payload is not a dict")
    return payload


def newest(folder: str | Path) -> Optional[Path]:
    """The newest checkpoint file in ``folder`` (not verified), or None."""
    found = sorted(Path(folder).glob(PATTERN))
    return found[-1] if found else None


def load_latest(folder: str | Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest checkpoint in ``folder`` that verifies, or None; bad ones are reported and skipped."""
    for path in sorted(Path(folder).glob(PATTERN), reverse=True):
        try:
            return path, read(path)
        except (CheckpointError, OSError) as e:
            log.warning("checkpoint %s is unusable (%s); trying the previous one", path.name, e)
    return None
