"""Text or JSONL files -> token shards with a real tokenizer: ``swarm-peer prepare-data`` (:func:`prepare`).

Inputs: ``.txt`` files (UTF-8, one document each) and ``.jsonl`` files (a document's text under ``text_field`` per
line), each document ended by the end-of-document token. Tokenizer: a given Hugging Face ``tokenizer.json``, or a
byte-level BPE trained on the inputs (``decode(encode(text)) == text``). Deterministic: the same inputs and options
give byte-identical files, so volunteers who prepare the same corpus get the same manifest, hence run hash.

Output directory, read by ``TokenShardSource`` (peer/local/data.py): ``shard_00000.bin``, ... (raw little-endian
ids, ``uint16`` when the vocabulary fits, else ``uint32``; one stream: a document may span two shards),
``tokenizer.json`` and ``manifest.json`` (tokenizer, dtype, per shard its token count and sha256, the sources and
options; no path and no time, so two copies of one prepared directory have the same manifest).

Files are written atomically, the manifest last: a directory with a manifest is complete. Input problems raise
:class:`PrepareError` (one line naming the file and line to fix).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from peer.errors import SetupError
from peer.local.manifest import MANIFEST_NAME, MANIFEST_VERSION, TOKEN_DTYPES, read_manifest

__all__ = ["PrepareError", "PreparedTokenizer", "prepare", "load_tokenizer", "token_dtype", "DEFAULT_SHARD_TOKENS",
           "DEFAULT_VOCAB_SIZE", "EOD_TOKEN"]

EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of a tokenizer trained here
# How common tokenizers name their end-of-document token, looked up in a given tokenizer.json (first found wins).
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
TOKENIZER_NAME = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16: few files for a large corpus, quick to copy and check
DEFAULT_VOCAB_SIZE = 32768
MIN_VOCAB_SIZE = 257  # the 256 bytes and the end-of-document token
_PIECE_CHARS = 1 << 20  # a long .txt document is encoded in pieces of about this many characters (memory)
_BATCH_CHARS = 1 << 23  # characters handed to the tokenizer at once (it encodes a batch in parallel)
_SHARD_NAME = re.compile(r"shard_\d{5}\.bin")


class PrepareError(SetupError):
    """An input or option of ``prepare`` to fix, as one line (``swarm-peer: error: ...``, exit status 2)."""


def token_dtype(vocab_size: int) -> str:
    """The manifest dtype of a vocabulary: ``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise PrepareError("the tokenizers package is missing: install the hf extra (pip install -e '.[hf]')") \
            from None
    return tokenizers


class PreparedTokenizer:
    """The tokenizer of prepared data: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``,
    ``eod_id``. ``encode`` adds no special token and reads a special token's text (``<|endoftext|>``) in its input
    as plain text, as preparation did; documents are separated by ``eod_id``."""

    def __init__(self, tokenizer: Any, eod_id: int) -> None:
        tokenizer.encode_special_tokens = True  # text that spells a special token is text, not a separator
        self._tok = tokenizer
        self.eod_id = eod_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))


def load_tokenizer(manifest_dir_or_file: str | os.PathLike) -> PreparedTokenizer:
    """The tokenizer of the prepared data at ``manifest_dir_or_file`` (its directory or ``manifest.json``), checked
    against the manifest's sha256. Raises ``ValueError`` (one line) when it is missing or changed."""
    manifest_file, manifest = read_manifest(manifest_dir_or_file)
    entry = manifest.get("tokenizer") or {}
    path = manifest_file.parent / str(entry.get("file", TOKENIZER_NAME))
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PrepareError(f"{path}: cannot read the prepared data's tokenizer ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise PrepareError(f"{path}: sha256 does not match {manifest_file.name}; copy or prepare the data again")
    tok = _tokenizers().Tokenizer.from_str(data.decode("utf-8"))
    return PreparedTokenizer(tok, int(entry["eod_id"]))


def _check_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    if not inputs:
        raise PrepareError("no input files: pass one or more .txt or .jsonl files")
    paths = [Path(p) for p in inputs]
    for path in paths:
        if path.is_dir():
            raise PrepareError(f"{path} is a directory; pass its files (e.g. {path}/*.txt)")
        if not path.is_file():
            raise PrepareError(f"input not found: {path}")
        if path.suffix not in (".txt", ".jsonl"):
            raise PrepareError(f"{path}: unsupported input type {path.suffix or '(none)'!r}; use .txt (UTF-8 text) "
                               f"or .jsonl (one JSON object per line)")
        if not os.access(path, os.R_OK):
            raise PrepareError(f"cannot read input {path}: permission denied")
    return paths


def _sources(paths: list[Path]) -> list[dict]:
    """Name, size and sha256 of every input (one read; the manifest's record of what was prepared)."""
    out = []
    for path in paths:
        h, size = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as e:
            raise PrepareError(f"cannot read input {path}: {e.strerror or e}") from None
        out.append({"name": path.name, "bytes": size, "sha256": h.hexdigest()})
    return out


def _pieces(paths: list[Path], text_field: str, advance: Callable[[int], None]) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` over every input in order; ``advance(n)`` after each ``n`` bytes read."""
    for path in paths:
        with open(path, "rb") as f:
            if path.suffix == ".jsonl":
                for lineno, raw in enumerate(f, 1):
                    advance(len(raw))
                    if raw.strip():
                        text = _jsonl_text(path, lineno, raw, text_field)
                        if text:
                            yield text, True
                continue
            buf: list[str] = []
            size, seen = 0, False
            for lineno, raw in enumerate(f, 1):
                advance(len(raw))
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise PrepareError(f"{path}:{lineno}: not UTF-8 text ({e.reason})") from None
                buf.append(line)
                size += len(line)
                seen = seen or bool(line)
                if size >= _PIECE_CHARS:  # cut after a line end: the same input always gives the same pieces
                    yield "".join(buf), False
                    buf, size = [], 0
            if seen:  # (an empty file is no document)
                yield "".join(buf), True


def _jsonl_text(path: Path, lineno: int, raw: bytes, text_field: str) -> str:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        raise PrepareError(f"{where}: not UTF-8 text ({e.reason})") from None
    except ValueError as e:
        raise PrepareError(f"{where}: not a JSON object ({e})") from None
    if not isinstance(obj, dict) or text_field not in obj:
        raise PrepareError(f"{where}: no field {text_field!r} (set --text-field to the field holding the text)")
    text = obj[text_field]
    if not isinstance(text, str):
        raise PrepareError(f"{where}: field {text_field!r} is a {type(text).__name__}, not a string")
    return text


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` by a temporary file, fsync and rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _find_eod(tok: Any, where: Path) -> tuple[str, int]:
    for name in EOD_CANDIDATES:
        if (i := tok.token_to_id(name)) is not None:
            return name, int(i)
    raise PrepareError(f"{where}: no end-of-document token (looked for {', '.join(EOD_CANDIDATES)}); use a "
                       f"tokenizer that has one, or leave out --tokenizer to train one")


def _train_bpe(paths: list[Path], text_field: str, vocab_size: int, advance: Callable[[int], None]) -> Any:
    """A byte-level BPE of ``vocab_size`` ids (fewer if the corpus has fewer pairs to merge) trained on the inputs;
    the end-of-document token is id 0. Deterministic: tokenizers breaks ties between merges by pair order."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                     special_tokens=[EOD_TOKEN],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for text, _ in _pieces(paths, text_field, advance)), trainer)
    return tok


class _ShardWriter:
    """Collects token ids into shards of ``shard_tokens`` and writes each one as it fills."""

    def __init__(self, out_dir: Path, dtype: str, shard_tokens: int) -> None:
        self.out_dir, self.dtype = out_dir, dtype
        self.buf = np.empty(shard_tokens, dtype=TOKEN_DTYPES[dtype])
        self.fill = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        while ids.size:
            n = min(ids.size, self.buf.size - self.fill)
            self.buf[self.fill:self.fill + n] = ids[:n]
            self.fill, ids = self.fill + n, ids[n:]
            if self.fill == self.buf.size:
                self.flush()

    def flush(self) -> None:
        if not self.fill:
            return
        data = self.buf[:self.fill].tobytes()
        name = f"shard_{len(self.shards):05d}.bin"
        _write_atomic(self.out_dir / name, data)
        self.shards.append({"file": name, "tokens": self.fill, "sha256": hashlib.sha256(data).hexdigest()})
        self.fill = 0


def _recipe(manifest: dict) -> Any:
    """What decides a prepared directory's content: equal recipes give byte-identical files."""
    tok = manifest.get("tokenizer") or {}
    how = tok.get("trained_vocab_size") if tok.get("origin") == "trained" else tok.get("sha256")
    return [manifest.get("version"), manifest.get("sources"), manifest.get("text_field"),
            manifest.get("shard_tokens"), tok.get("origin"), how]


def _check_out_dir(out_dir: Path, recipe: Any, force: bool) -> None:
    """Refuses an ``out_dir`` holding data prepared from other inputs or options, unless ``force`` (then its
    manifest goes first, so the directory never lists shards that are being replaced)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepareError(f"--out {out_dir} is a file; choose a directory")
    old = out_dir / MANIFEST_NAME
    if not old.exists():
        return
    try:
        same = _recipe(json.loads(old.read_bytes())) == recipe
    except (OSError, ValueError, AttributeError):
        same = False
    if not same and not force:
        raise PrepareError(f"--out {out_dir} already holds prepared data of other inputs or options; pass --force "
                           f"to replace it, or choose another --out")
    old.unlink()


def prepare(inputs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *, tokenizer: str | None = None,
            vocab_size: int | None = None, text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS,
            force: bool = False, progress: bool = False) -> dict:
    """Tokenizes ``inputs`` into ``out_dir`` (see the module docstring) and returns the manifest written.

    ``tokenizer``: a ``tokenizer.json`` to use; otherwise a byte-level BPE of ``vocab_size`` (default
    ``DEFAULT_VOCAB_SIZE``) ids is trained on the inputs (a second pass over them). ``progress``: a bar on stderr.
    Raises :class:`PrepareError` for a missing, unreadable or malformed input, an empty corpus, a bad option, or an
    ``out_dir`` that holds data prepared otherwise (unless ``force``).
    """
    if tokenizer is not None and vocab_size is not None:
        raise PrepareError("--tokenizer and --vocab-size exclude each other: a given tokenizer has its own vocabulary")
    if shard_tokens < 1:
        raise PrepareError(f"--shard-tokens must be >= 1 (got {shard_tokens})")
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    if tokenizer is None and not MIN_VOCAB_SIZE <= vocab_size <= 1 << 20:
        raise PrepareError(f"--vocab-size must be in [{MIN_VOCAB_SIZE}, 1048576] (the 256 bytes and the "
                           f"end-of-document token at least), got {vocab_size}")
    paths, out = _check_inputs(inputs), Path(out_dir)
    given = Path(tokenizer) if tokenizer is not None else None
    given_bytes = b""
    if given is not None:
        try:
            given_bytes = given.read_bytes()
        except OSError as e:
            raise PrepareError(f"--tokenizer {given}: cannot read ({e.strerror or e})") from None
    sources = _sources(paths)
    tok_entry: dict[str, Any] = ({"origin": "given", "sha256": hashlib.sha256(given_bytes).hexdigest()}
                                 if given is not None else {"origin": "trained", "trained_vocab_size": vocab_size})
    manifest: dict[str, Any] = {"version": MANIFEST_VERSION, "sources": sources, "text_field": text_field,
                                "shard_tokens": shard_tokens, "tokenizer": tok_entry}
    _check_out_dir(out, _recipe(manifest), force)

    total_bytes = sum(s["bytes"] for s in sources)
    passes = 1 if given is not None else 2
    bar = _progress_bar(total_bytes * passes, progress, "tokenizing" if given else "training tokenizer")
    try:
        if given is not None:
            try:
                tok = _tokenizers().Tokenizer.from_str(given_bytes.decode("utf-8"))
            except Exception as e:  # tokenizers raises plain Exceptions for a malformed file
                why = (str(e).splitlines() or [type(e).__name__])[0]
                raise PrepareError(f"--tokenizer {given}: not a Hugging Face tokenizer.json ({why})") from None
            tok_json = given_bytes
        else:
            tok = _train_bpe(paths, text_field, vocab_size, bar.update)
            tok_json = tok.to_str().encode("utf-8")
        eod_name, eod_id = _find_eod(tok, given or Path(TOKENIZER_NAME))
        prepared = PreparedTokenizer(tok, eod_id)
        dtype = token_dtype(prepared.vocab_size)
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        writer = _ShardWriter(out, dtype, shard_tokens)
        bar.set_description("tokenizing")
        try:
            _encode_all(prepared, _pieces(paths, text_field, bar.update), writer)
            writer.flush()
            if not writer.shards:
                raise PrepareError(f"the inputs hold no text ({', '.join(map(str, paths))}): nothing to prepare")
        except BaseException:  # leave no shards without a manifest behind (a bad line found mid-way, Ctrl-C)
            for sh in writer.shards:
                (out / sh["file"]).unlink(missing_ok=True)
            if created and not any(out.iterdir()):
                out.rmdir()
            raise
    finally:
        bar.close()
    total = sum(sh["tokens"] for sh in writer.shards)
    _write_atomic(out / TOKENIZER_NAME, tok_json)
    tok_entry.update(file=TOKENIZER_NAME, sha256=hashlib.sha256(tok_json).hexdigest(), eod_token=eod_name,
                     eod_id=eod_id)
    manifest.update(vocab_size=prepared.vocab_size, dtype=dtype, total_tokens=total, shards=writer.shards)
    _write_atomic(out / MANIFEST_NAME, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    listed = {sh["file"] for sh in writer.shards}
    for stale in out.iterdir():  # shards of an earlier preparation (--force) that the manifest no longer lists
        if _SHARD_NAME.fullmatch(stale.name) and stale.name not in listed:
            stale.unlink()
    return manifest


def _encode_all(tok: PreparedTokenizer, pieces: Iterator[tuple[str, bool]], writer: _ShardWriter) -> None:
    """Encodes ``pieces`` in batches (the tokenizer uses its threads) and writes the ids, an EOD after each
    document."""
    batch: list[tuple[str, bool]] = []
    size = 0

    def drain() -> None:
        for ids, (_, ends) in zip(tok.encode_batch([text for text, _ in batch]), batch):
            writer.add(np.asarray(ids + [tok.eod_id] if ends else ids, dtype=np.int64))
        batch.clear()

    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= _BATCH_CHARS:
            drain()
            size = 0
    drain()


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_description(self, desc: str) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar over input bytes on stderr, or one that shows nothing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    import sys

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr)
