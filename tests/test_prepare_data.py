"""``swarm-peer prepare-data`` (peer/local/prepare.py, peer/cli/prepare_data.py) and the ``tokens`` data source
(``TokenShardSource`` in peer/local/data.py): text -> a trained byte-level BPE -> shards + manifest, deterministic;
the source serves windows within the vocabulary and resumes its cursor; every problem is one line naming what to
fix; the run hash follows the manifest's content, not its path."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from peer.config import DataConfig, ModelConfig, PeerConfig
from peer.errors import SetupError
from peer.local.data import TokenShardSource, make_source
from peer.local.prepare import EOD_TOKEN, PrepareError, load_tokenizer, prepare, token_dtype

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "configs/data/sample.txt"
SWARM_PEER = Path(sys.executable).parent / "swarm-peer"  # the console script, as a user runs it
VOCAB, SHARD_TOKENS = 512, 4000  # the sample gives ~11.6k tokens: three shards


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prep") / "sample"
    prepare([SAMPLE], out, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)
    return out


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


def swarm_peer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SWARM_PEER), "prepare-data", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_prepares_the_sample_and_prints_the_config(tmp_path, prepared):
    proc = swarm_peer(str(SAMPLE), "--out", "data", "--vocab-size", str(VOCAB), "--shard-tokens", str(SHARD_TOKENS),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bar: stderr is not a terminal
    out = tmp_path / "data"
    m = json.loads((out / "manifest.json").read_text())
    assert proc.stdout.splitlines()[0] == (f"prepared {m['total_tokens']:,} tokens in 3 shards (vocab {VOCAB}, "
                                           f"uint16) in data")
    toml = tomllib.loads(proc.stdout[proc.stdout.index("[data]"):])
    assert toml == {"data": {"source": "tokens", "paths": ["data"], "vocab_size": VOCAB}}
    assert DataConfig(**toml["data"]).source == "tokens"  # the lines are a valid [data] section

    assert m["version"] == 1 and m["vocab_size"] == VOCAB and m["dtype"] == "uint16"
    assert m["sources"] == [{"name": "sample.txt", "bytes": SAMPLE.stat().st_size,
                             "sha256": hashlib.sha256(SAMPLE.read_bytes()).hexdigest()}]
    assert [sh["file"] for sh in m["shards"]] == ["shard_00000.bin", "shard_00001.bin", "shard_00002.bin"]
    assert [sh["tokens"] for sh in m["shards"][:2]] == [SHARD_TOKENS, SHARD_TOKENS]
    assert sum(sh["tokens"] for sh in m["shards"]) == m["total_tokens"] > 2 * SHARD_TOKENS
    for sh in m["shards"]:
        data = (out / sh["file"]).read_bytes()
        assert len(data) == 2 * sh["tokens"] and hashlib.sha256(data).hexdigest() == sh["sha256"]
    tok = (out / "tokenizer.json").read_bytes()
    assert m["tokenizer"]["file"] == "tokenizer.json" and m["tokenizer"]["sha256"] == hashlib.sha256(tok).hexdigest()
    assert m["tokenizer"]["eod_token"] == EOD_TOKEN
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    # Deterministic across processes (the fixture was prepared in this one): byte-identical files.
    assert files_of(out) == files_of(prepared)


def test_cli_input_error_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    proc = swarm_peer("docs.jsonl", "--out", "data", "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "swarm-peer: error: docs.jsonl:2: no field 'text' (set --text-field to the field holding the text)"]
    assert not (tmp_path / "data").exists()


def test_deterministic_and_round_trip(tmp_path, prepared):
    again = tmp_path / "again"
    prepare([SAMPLE], again, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)
    assert files_of(again) == files_of(prepared)

    tok = load_tokenizer(prepared / "manifest.json")
    assert tok.vocab_size == VOCAB and tok.decode([tok.eod_id]) == EOD_TOKEN
    text = SAMPLE.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < VOCAB
    odd = "naïve café — 東京 🚀 and a literal <|endoftext|> in the text"
    assert tok.decode(tok.encode(odd)) == odd and tok.eod_id not in tok.encode(odd)
    # The shards are the document's ids then the end-of-document token.
    stream = np.concatenate([np.fromfile(p, dtype="<u2") for p in sorted(prepared.glob("shard_*.bin"))])
    assert stream.tolist() == ids + [tok.eod_id]


def test_documents_of_text_and_jsonl_are_separated(tmp_path):
    (tmp_path / "a.txt").write_text("The first document.\nIt has two lines.\n")
    (tmp_path / "b.jsonl").write_text('{"body": "Second one."}\n\n{"body": "", "x": 1}\n{"body": "Third."}\n')
    m = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "out", vocab_size=300, text_field="body")
    tok = load_tokenizer(tmp_path / "out")
    stream = np.fromfile(tmp_path / "out" / m["shards"][0]["file"], dtype="<u2").tolist()
    docs = tok.decode(stream).split(EOD_TOKEN)
    assert docs == ["The first document.\nIt has two lines.\n", "Second one.", "Third.", ""]  # empty text: no doc


def test_dtype_follows_the_vocabulary(tmp_path):
    assert token_dtype(256) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == token_dtype(1 << 20) == "uint32"
    # A given tokenizer.json with 70,000 ids whose end-of-document token is the last one (id 69,999).
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    names = alphabet + [f"filler{i}" for i in range(70_000 - len(alphabet) - 1)] + [EOD_TOKEN]
    vocab = {name: i for i, name in enumerate(names)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([EOD_TOKEN])
    tk.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("ab " * 40)
    m = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer=str(tmp_path / "big.json"))
    assert m["vocab_size"] == 70_000 and m["dtype"] == "uint32" and m["tokenizer"]["eod_id"] == 69_999
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (tmp_path / "big.json").read_bytes()  # verbatim
    stream = np.fromfile(tmp_path / "out/shard_00000.bin", dtype="<u4")
    assert stream.size == 121 and stream[-1] == 69_999 and (tmp_path / "out/shard_00000.bin").stat().st_size == 484
    src = TokenShardSource(str(tmp_path / "out"), vocab_size=70_000, seed=0, shard_index=0, num_shards=1)
    batch = src.next_batch(1, 120)
    assert batch.dtype.is_floating_point is False and 69_999 in batch.tolist()[0]
    with pytest.raises(ValueError) as e:
        TokenShardSource(str(tmp_path / "out"), vocab_size=65_536, seed=0)
    assert "set data.vocab_size = 70000" in one_line(e)


def test_source_windows_within_vocab_and_resume_after_restart(prepared):
    total = json.loads((prepared / "manifest.json").read_text())["total_tokens"]
    src = make_source("tokens", paths=[str(prepared)], vocab_size=VOCAB, seed=7, shard_index=3)
    assert isinstance(src, TokenShardSource) and src.num_tokens == total
    src.check(64)
    b = src.next_batch(4, 64)
    assert b.shape == (4, 65) and b.dtype.is_floating_point is False
    assert 0 <= int(b.min()) and int(b.max()) < VOCAB
    assert (b[1:, 0] == b[:-1, 64]).all()  # consecutive windows, stride seq_len
    for _ in range(30):  # past the end of the stream: it wraps around
        src.next_batch(4, 64)
    state = json.loads(json.dumps(src.state_dict()))
    want = [src.next_batch(4, 64) for _ in range(3)]
    # A restarted peer (a new source, through the manifest's path this time) resumes exactly.
    restarted = make_source("tokens", paths=[str(prepared / "manifest.json")], vocab_size=VOCAB, seed=7,
                            shard_index=3)
    restarted.load_state_dict(state)
    assert all((restarted.next_batch(4, 64) == w).all() for w in want)
    other = make_source("tokens", paths=[str(prepared)], vocab_size=VOCAB, seed=7, shard_index=4)
    assert not (other.next_batch(4, 64) == make_source("tokens", paths=[str(prepared)], vocab_size=VOCAB, seed=7,
                                                       shard_index=3).next_batch(4, 64)).all()
    with pytest.raises(ValueError, match="shard_index"):
        other.load_state_dict(state)


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(prepared, dst)
    return dst


def test_a_corrupt_or_truncated_shard_is_named(tmp_path, prepared):
    d = copy_of(prepared, tmp_path)
    shard = d / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        make_source("tokens", paths=[str(d)], vocab_size=VOCAB, seed=0, shard_index=0)
    assert f"{shard}: sha256 does not match manifest.json" in one_line(e)
    TokenShardSource(str(d), VOCAB, 0, verify_checksums=False)  # the size check alone does not see it
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError) as e:
        TokenShardSource(str(d), VOCAB, 0, verify_checksums=False)
    assert f"{shard}: {len(data) - 2} bytes, the manifest says {len(data)}" in one_line(e)
    shard.unlink()
    with pytest.raises(ValueError) as e:
        TokenShardSource(str(d), VOCAB, 0)
    assert "shard_00001.bin: shard listed in manifest.json is missing" in one_line(e)


def test_preflight_reports_the_data_before_joining(tmp_path, prepared):
    from peer.run.preflight import open_data

    def cfg(path: Path, vocab: int = VOCAB, seq_len: int = 32) -> PeerConfig:
        return PeerConfig(model=ModelConfig(seq_len=seq_len),
                          data=DataConfig(source="tokens", paths=[str(path)], vocab_size=vocab))

    assert open_data(cfg(prepared), 5).next_batch(2, 32).shape == (2, 33)
    with pytest.raises(SetupError) as e:
        open_data(cfg(prepared, vocab=256), 0)
    assert one_line(e).endswith(f"vocabulary has {VOCAB} tokens, more than the model's data.vocab_size = 256; "
                                f"set data.vocab_size = {VOCAB}")
    (tmp_path / "short.txt").write_text("Too short to train on.")
    prepare([tmp_path / "short.txt"], tmp_path / "short", vocab_size=300)
    with pytest.raises(SetupError) as e:
        open_data(cfg(tmp_path / "short", seq_len=64), 0)
    assert "fewer than one sequence (model.seq_len + 1 = 65)" in one_line(e) and str(tmp_path / "short") in str(e)
    d = copy_of(prepared, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, "version": 2}))
    with pytest.raises(SetupError) as e:
        open_data(cfg(d), 0)
    assert "unknown manifest version 2 (this swarm-peer reads version 1)" in one_line(e)
    with pytest.raises(SetupError) as e:
        open_data(cfg(tmp_path / "nowhere"), 0)
    assert one_line(e).startswith(f"data: {tmp_path / 'nowhere'} not found: data.paths names the directory that "
                                  f"swarm-peer prepare-data")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SetupError) as e:
        open_data(cfg(tmp_path / "empty"), 0)
    assert one_line(e).startswith(f"data: {tmp_path / 'empty/manifest.json'} not found")


@pytest.mark.parametrize("content, match", [
    ('{"text": "ok"}\n{"title": "no text"}\n', "in.jsonl:2: no field 'text'"),
    ('{"text": "ok"}\n\n{"text": "x"\n', "in.jsonl:3: not a JSON object"),
    ('{"text": 3}\n', "in.jsonl:1: field 'text' is a int, not a string"),
    ('\n{"text": ""}\n', "the inputs hold no text"),
])
def test_input_errors_are_one_line(tmp_path, content, match):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(PrepareError) as e:
        prepare([tmp_path / "in.jsonl"], tmp_path / "out", vocab_size=300)
    assert match in one_line(e)
    assert not (tmp_path / "out").exists()


def test_option_and_path_errors(tmp_path, prepared):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "a.csv").write_text("hello")
    for inputs, kwargs, match in [
        ([tmp_path / "missing.txt"], {}, "input not found"),
        ([tmp_path], {}, "is a directory; pass its files"),
        ([tmp_path / "a.csv"], {}, "unsupported input type '.csv'"),
        ([tmp_path / "a.txt"], {"vocab_size": 100}, "--vocab-size must be in [257, 1048576]"),
        ([tmp_path / "a.txt"], {"tokenizer": str(tmp_path / "a.txt")}, "not a Hugging Face tokenizer.json"),
    ]:
        with pytest.raises(PrepareError) as e:
            prepare(inputs, tmp_path / "out", **kwargs)
        assert match in one_line(e)
    # An output directory that holds other prepared data: refused without --force.
    d = copy_of(prepared, tmp_path)
    before = files_of(d)
    with pytest.raises(PrepareError) as e:
        prepare([SAMPLE], d, vocab_size=VOCAB + 1, shard_tokens=SHARD_TOKENS)
    assert "already holds prepared data of other inputs or options; pass --force" in one_line(e)
    assert files_of(d) == before
    prepare([SAMPLE], d, vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)  # the same recipe: allowed, same files
    assert files_of(d) == before
    m = prepare([SAMPLE], d, vocab_size=VOCAB, shard_tokens=10 * SHARD_TOKENS, force=True)
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "shard_00000.bin", "tokenizer.json"]
    assert len(m["shards"]) == 1


def test_run_hash_follows_the_manifest_content_not_its_path(tmp_path, prepared):
    def run_hash(path: Path) -> str:
        return PeerConfig(data=DataConfig(source="tokens", paths=[str(path)], vocab_size=1024)).run_hash()

    same = [run_hash(prepared), run_hash(copy_of(prepared, tmp_path)), run_hash(tmp_path / "copy/manifest.json")]
    assert len(set(same)) == 1
    prepare([SAMPLE], tmp_path / "vocab", vocab_size=VOCAB + 64, shard_tokens=SHARD_TOKENS)
    (tmp_path / "more.txt").write_text(SAMPLE.read_text() + "\nOne more line.\n")
    prepare([tmp_path / "more.txt"], tmp_path / "more", vocab_size=VOCAB, shard_tokens=SHARD_TOKENS)
    hashes = {same[0], run_hash(tmp_path / "vocab"), run_hash(tmp_path / "more")}
    assert len(hashes) == 3
