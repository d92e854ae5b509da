"""Token streams for the inner loop: a synthetic Markov corpus, local text, uint16 shards, prepared token shards.

Every source (:class:`TokenSource`, made by :func:`make_source`) returns int64 batches ``[batch_size, seq_len + 1]``
from ``next_batch`` (inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``), deterministic given ``(seed, shard_index)``;
its read position is a JSON-serialisable cursor (``state_dict``), so a restored peer yields the same batches.

- :class:`~peer.local.markov.MarkovSource` (default): a seeded Markov chain with a closed-form entropy rate.
- :class:`TextFileSource`: local files through a byte-level tokenizer (vocab 256).
- :class:`BinShardSource`: pre-tokenized raw little-endian uint16 files (no header), memory-mapped.
- :class:`TokenShardSource`: ``swarm-peer prepare-data``'s output (peer/local/prepare.py), checked, memory-mapped.

File sources read one cyclic stream in windows of ``seq_len + 1`` tokens, stride ``seq_len``, but for its last
``holdout`` fraction, held out to evaluate the shared model (``held_out``: the same windows on every peer; the
synthetic corpus holds out a stream of its own). A shard starts at its own offset: evenly spaced when ``num_shards``
is known, else seeded pseudo-random (a volunteer swarm does not know how many shards there will be).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from peer.local.inputs import check_data_paths
from peer.local.manifest import TOKEN_DTYPES, read_manifest
from peer.local.markov import TAG_OFFSET, MarkovSource, check_cursor, check_shape, derive_seed

__all__ = [
    "TokenSource",
    "TextFileSource",
    "BinShardSource",
    "TokenShardSource",
    "byte_encode",
    "byte_decode",
    "make_source",
]

BYTE_VOCAB = 256


class TokenSource(Protocol):
    """What the inner loop needs from a data source."""

    vocab_size: int
    entropy_floor: float | None

    def next_batch(self, batch_size: int, seq_len: int) -> Tensor: ...
    def held_out(self, sequences: int, seq_len: int) -> Tensor | None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def byte_encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids in [0, 256)."""
    return list(text.encode("utf-8"))


def byte_decode(tokens: list[int]) -> str:
    """Inverse of ``byte_encode``; invalid UTF-8 (e.g. a cut sequence) becomes U+FFFD."""
    return bytes(tokens).decode("utf-8", errors="replace")


class _WindowSource:
    """Consecutive windows over the cyclic concatenation of named token arrays."""

    kind = ""

    def __init__(
        self,
        segments: list[tuple[str, np.ndarray]],
        vocab_size: int,
        seed: int,
        shard_index: int,
        num_shards: int | None,
        holdout: float = 0.0,
    ) -> None:
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"data.holdout must be in [0, 1), got {holdout}")
        if seed < 0 or shard_index < 0:
            raise ValueError(f"seed and shard_index must be >= 0, got {seed}, {shard_index}")
        if num_shards is not None and not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} out of range for num_shards={num_shards}")
        self.vocab_size = vocab_size
        self.entropy_floor: float | None = None
        self.seed, self.shard_index = seed, shard_index
        self._names = [name for name, _ in segments]
        self._arrays = [arr for _, arr in segments]
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])
        self.label = ", ".join(self._names)  # what ``check`` calls the data
        total = int(self._starts[-1])
        self.held_tokens = int(total * holdout)  # the stream's last tokens: never trained on
        self.num_tokens = n = total - self.held_tokens  # the training stream
        if n < 1:
            raise ValueError(f"{self.label}: data.holdout = {holdout} leaves no tokens to train on")
        base = derive_seed(TAG_OFFSET, seed) % n
        if num_shards is None:
            self._start = derive_seed(TAG_OFFSET, seed, shard_index) % n
        else:
            self._start = (base + shard_index * n // num_shards) % n
        self._position = self._start

    def _gather(self, index: np.ndarray) -> np.ndarray:
        """Tokens at global positions ``index`` (any shape), with a vocab check per file."""
        flat = index.ravel()
        seg = np.searchsorted(self._starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=np.int64)
        for s in np.unique(seg):
            mask = seg == s
            vals = np.asarray(self._arrays[s][flat[mask] - self._starts[s]], dtype=np.int64)
            if vals.size and int(vals.max()) >= self.vocab_size:
                raise ValueError(
                    f"{self._names[s]}: token id {int(vals.max())} >= vocab_size {self.vocab_size}; "
                    "re-tokenize the shard or raise model vocab_size"
                )
            out[mask] = vals
        return out.reshape(index.shape)

    def check(self, seq_len: int) -> None:
        """Raises ``ValueError`` unless a window of ``seq_len + 1`` tokens fits and the first one has valid ids
        (the cursor does not move)."""
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"{self.kind} data {self.label} has {self.num_tokens} tokens, fewer than "
                             f"one sequence (model.seq_len + 1 = {seq_len + 1})")
        self._gather((self._position + np.arange(seq_len + 1, dtype=np.int64)) % self.num_tokens)

    def next_batch(self, batch_size: int, seq_len: int) -> Tensor:
        """Return int64 ``[batch_size, seq_len + 1]``: the next ``batch_size`` windows."""
        check_shape(batch_size, seq_len)
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"{self.kind} data has {self.num_tokens} tokens, fewer than seq_len+1={seq_len + 1}")
        starts = self._position + seq_len * np.arange(batch_size, dtype=np.int64)
        index = (starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)) % self.num_tokens
        batch = torch.from_numpy(self._gather(index))
        self._position = int((self._position + batch_size * seq_len) % self.num_tokens)
        return batch

    def held_out(self, sequences: int, seq_len: int) -> Tensor | None:
        """Up to ``sequences`` consecutive windows of the held-out tokens (the same on every peer), as
        ``[k, seq_len + 1]``; None if fewer than ``seq_len + 1`` tokens are held out."""
        check_shape(sequences, seq_len)
        k = min(sequences, (self.held_tokens - 1) // seq_len) if self.held_tokens > seq_len else 0
        if k == 0:
            return None
        starts = self.num_tokens + seq_len * np.arange(k, dtype=np.int64)
        return torch.from_numpy(self._gather(starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)))

    def state_dict(self) -> dict:
        return {
            "kind": self.kind,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "num_tokens": self.num_tokens,
            "position": self._position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; raises ValueError if the state is for other data."""
        check_cursor(state, self.state_dict(), ("kind", "seed", "shard_index", "num_tokens"),
                     {"num_tokens": " (the data or data.holdout changed)"})
        self._position = int(state["position"]) % self.num_tokens


class TextFileSource(_WindowSource):
    """Local text files, byte-tokenized (vocab 256), read fully into memory."""

    kind = "text"

    def __init__(self, paths: list[str], seed: int, shard_index: int = 0, num_shards: int | None = None, *,
                 holdout: float = 0.0) -> None:
        check_data_paths(self.kind, paths)
        segments = []
        for path in paths:
            with open(path, "rb") as f:  # raw bytes == byte_encode of the decoded text
                segments.append((path, np.frombuffer(f.read(), dtype=np.uint8)))
        super().__init__(segments, BYTE_VOCAB, seed, shard_index, num_shards, holdout)


class BinShardSource(_WindowSource):
    """Raw little-endian uint16 token files (no header), memory-mapped.

    Token ids are checked against ``vocab_size`` for every window served; an id out of
    range raises ``ValueError`` naming the file.
    """

    kind = "bin"

    def __init__(
        self, paths: list[str], vocab_size: int, seed: int, shard_index: int = 0, num_shards: int | None = None, *,
        holdout: float = 0.0,
    ) -> None:
        check_data_paths(self.kind, paths)
        if not 0 < vocab_size <= 65536:
            raise ValueError(f"bin source stores uint16 ids: vocab_size must be in 1..65536, got {vocab_size}")
        segments: list[tuple[str, np.ndarray]] = []
        for path in paths:
            if os.path.getsize(path) % 2:
                raise ValueError(f"{path}: size is odd, not a uint16 token file")
            segments.append((path, np.memmap(path, dtype="<u2", mode="r")))
        super().__init__(segments, vocab_size, seed, shard_index, num_shards, holdout)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class TokenShardSource(_WindowSource):
    """Prepared data (``swarm-peer prepare-data``): the shards a ``manifest.json`` lists, in its order, as one
    cyclic token stream, memory-mapped with the manifest's dtype (uint16 or uint32, little-endian).

    Checked when built, each failure one line naming what to fix: the manifest's version, a vocabulary larger than
    the model's (``vocab_size``), every shard's size against its token count, and (``verify_checksums``, the
    default) every shard's sha256. The checksums read every shard once, at start: about 1 s per GB on a CPU with
    SHA extensions (2-4 s without), or the disk's read time if slower (a 10 GB corpus on a hard disk: a minute or
    two); the size check costs nothing. A corpus shorter than one sequence is reported by ``check(seq_len)``.
    """

    kind = "tokens"

    def __init__(self, path: str, vocab_size: int, seed: int, shard_index: int = 0, num_shards: int | None = None,
                 *, verify_checksums: bool = True, holdout: float = 0.0) -> None:
        file, manifest = read_manifest(path)
        self.manifest, self.manifest_path = manifest, file
        data_vocab = int(manifest["vocab_size"])
        if data_vocab > vocab_size:
            raise ValueError(f"{file}: the prepared data's vocabulary has {data_vocab} tokens, more than the "
                             f"model's data.vocab_size = {vocab_size}; set data.vocab_size = {data_vocab}")
        dtype = np.dtype(TOKEN_DTYPES[manifest["dtype"]])
        segments: list[tuple[str, np.ndarray]] = []
        for shard in manifest["shards"]:
            name, tokens = str(shard["file"]), int(shard["tokens"])
            shard_path = file.parent / name
            if not shard_path.is_file():
                raise ValueError(f"{shard_path}: shard listed in {file.name} is missing; copy the whole prepared "
                                 f"directory again")
            size, want = shard_path.stat().st_size, tokens * dtype.itemsize
            if size != want:
                raise ValueError(f"{shard_path}: {size} bytes, the manifest says {want} ({tokens} {manifest['dtype']} "
                                 f"tokens); the shard is truncated or changed: copy or prepare the data again")
            if verify_checksums and _sha256_file(shard_path) != shard["sha256"]:
                raise ValueError(f"{shard_path}: sha256 does not match {file.name}; the shard is corrupt or changed: "
                                 f"copy or prepare the data again")
            if tokens:  # numpy cannot map an empty file
                segments.append((name, np.memmap(shard_path, dtype=dtype, mode="r")))
        if not segments:
            raise ValueError(f"{file}: the prepared data holds no tokens; prepare it again from non-empty inputs")
        super().__init__(segments, vocab_size, seed, shard_index, num_shards, holdout)
        self.label = str(file.parent)


def make_source(
    kind: str,
    *,
    paths: list[str],
    vocab_size: int,
    seed: int,
    shard_index: int,
    num_shards: int | None = None,
    holdout: float = 0.0,
) -> MarkovSource | TextFileSource | BinShardSource | TokenShardSource:
    """Build the data source named by ``kind`` ("synthetic", "text", "bin" or "tokens"); ``holdout``: the fraction
    of a file corpus held out of training (the synthetic corpus holds out a stream of its own).

    Raises ``ValueError`` with a one-line message naming the option or file to fix:
    unknown kind, paths given to "synthetic", no paths, a missing or empty file, or a
    vocab mismatch ("text" requires ``vocab_size == 256``); for "tokens" (one path: the
    prepared directory or its manifest), see ``TokenShardSource``.
    """
    check_data_paths(kind, paths)  # every kind's (a text or bin source built alone checks its own too)
    if kind == "synthetic":
        return MarkovSource(vocab_size, seed, shard_index)
    if kind == "text":
        if vocab_size != BYTE_VOCAB:
            raise ValueError(f"data.source = 'text' uses the byte tokenizer: set vocab_size = 256 (got {vocab_size})")
        return TextFileSource(list(paths), seed, shard_index, num_shards, holdout=holdout)
    if kind == "bin":
        return BinShardSource(list(paths), vocab_size, seed, shard_index, num_shards, holdout=holdout)
    return TokenShardSource(paths[0], vocab_size, seed, shard_index, num_shards, holdout=holdout)
