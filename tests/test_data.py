"""Tests for peer/local/data.py: Markov corpus, text and bin sources, cursors, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from peer.local.data import (
    BinShardSource,
    TextFileSource,
    byte_decode,
    byte_encode,
    make_source,
)
from peer.local.markov import MarkovSource


def _roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))  # cursors must be plain JSON


def _write_bin(path, tokens) -> str:
    np.asarray(tokens, dtype="<u2").tofile(path)
    return str(path)


# --- Markov source ---

def test_markov_floor_in_intended_range_and_pi_stationary():
    src = MarkovSource(256, seed=0)
    assert 1.5 < src.entropy_rate < 3.0 < math.log(256)
    assert src.entropy_floor == src.entropy_rate
    pi = src.stationary
    assert abs(pi.sum() - 1) < 1e-12 and (pi > 0).all()
    dense = np.zeros((256, 256))
    np.put_along_axis(dense, src._succ_np, src._probs_np, axis=1)
    np.testing.assert_allclose(pi @ dense, pi, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 7])
def test_markov_entropy_rate_matches_monte_carlo(seed):
    src = MarkovSource(256, seed=seed, shard_index=3)
    batch = src.next_batch(64, 512)
    lp = src.log_prob(batch)
    assert torch.isfinite(lp).all()  # every sampled transition is on the chain's support
    # -log p averaged over 32768 targets; its standard error is about 0.01 nats.
    assert abs(-lp.mean().item() - src.entropy_rate) < 0.05
    # First tokens follow π: the optimal CE holds from the very first target on.
    assert abs(-lp[:, 0].mean().item() - src.entropy_rate) < 0.3


def test_markov_shape_dtype_and_small_vocab():
    batch = MarkovSource(5, seed=1).next_batch(4, 9)
    assert batch.shape == (4, 10) and batch.dtype == torch.int64
    assert batch.min() >= 0 and batch.max() < 5


def test_markov_deterministic_per_seed_and_shard():
    def first(seed, shard):
        return MarkovSource(128, seed=seed, shard_index=shard).next_batch(4, 32)

    assert torch.equal(first(1, 0), first(1, 0))
    assert not torch.equal(first(1, 0), first(1, 1))
    assert not torch.equal(first(1, 0), first(2, 0))
    # Shards share the chain (same language), only the samples differ.
    a, b = MarkovSource(128, seed=1, shard_index=0), MarkovSource(128, seed=1, shard_index=5)
    assert a.entropy_rate == b.entropy_rate


def test_markov_cursor_resume():
    src = MarkovSource(64, seed=3, shard_index=2)
    src.next_batch(2, 8)
    state = _roundtrip(src.state_dict())
    expected = [src.next_batch(2, 8), src.next_batch(3, 5)]
    restored = MarkovSource(64, seed=3, shard_index=2)
    restored.load_state_dict(state)
    assert all(torch.equal(e, restored.next_batch(*e.shape[:1], e.shape[1] - 1)) for e in expected)
    with pytest.raises(ValueError, match="shard_index"):
        MarkovSource(64, seed=3, shard_index=1).load_state_dict(state)


# --- byte tokenizer and text files ---

def test_byte_tokenizer_roundtrip():
    text = "héllo, wörld ✓\n"
    tokens = byte_encode(text)
    assert all(0 <= t < 256 for t in tokens) and len(tokens) == len(text.encode())
    assert byte_decode(tokens) == text


def test_text_source_serves_consecutive_windows(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox ")
    b.write_text("jumps over the lazy dog. ")
    stream = np.array(byte_encode(a.read_text() + b.read_text()))
    src = TextFileSource([str(a), str(b)], seed=0, shard_index=0)
    assert src.vocab_size == 256 and src.entropy_floor is None and src.num_tokens == len(stream)
    start = src.state_dict()["position"]
    batch = src.next_batch(3, 7)
    assert batch.shape == (3, 8) and batch.dtype == torch.int64
    idx = (start + np.arange(3 * 7 + 1)) % len(stream)
    flat = np.concatenate([batch[0, :-1], batch[1, :-1], batch[2]])
    np.testing.assert_array_equal(flat, stream[idx])  # windows overlap by one token
    assert src.state_dict()["position"] == (start + 21) % len(stream)


def test_text_source_shards_and_determinism(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(chr(97 + i % 26) * (1 + i % 3) for i in range(400)))

    def first(seed, shard, num_shards=None):
        return TextFileSource([str(path)], seed=seed, shard_index=shard, num_shards=num_shards).next_batch(2, 16)

    assert torch.equal(first(0, 1), first(0, 1))
    assert not torch.equal(first(0, 0), first(0, 1))
    assert not torch.equal(first(0, 0), first(1, 0))
    n = TextFileSource([str(path)], seed=0).num_tokens
    starts = [
        TextFileSource([str(path)], seed=0, shard_index=s, num_shards=4).state_dict()["position"] for s in range(4)
    ]
    gaps = sorted((starts[(i + 1) % 4] - starts[i]) % n for i in range(4))
    assert gaps[0] >= n // 4 - 1  # evenly spaced: disjoint for the first quarter pass


def test_text_source_cursor_resume(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 20)
    src = TextFileSource([str(path)], seed=5, shard_index=1)
    src.next_batch(4, 9)
    state = _roundtrip(src.state_dict())
    expected = [src.next_batch(4, 9) for _ in range(3)]
    restored = TextFileSource([str(path)], seed=5, shard_index=1)
    restored.load_state_dict(state)
    for e in expected:
        assert torch.equal(e, restored.next_batch(4, 9))


# --- uint16 bin shards ---

def test_bin_source_reads_tokens_across_files(tmp_path):
    first = _write_bin(tmp_path / "0.bin", np.arange(0, 50))
    second = _write_bin(tmp_path / "1.bin", np.arange(1000, 1030))
    src = BinShardSource([first, second], vocab_size=2000, seed=0, shard_index=0, num_shards=1)
    stream = np.concatenate([np.arange(0, 50), np.arange(1000, 1030)])
    start = src.state_dict()["position"]
    batch = src.next_batch(4, 10)
    for row in range(4):
        idx = (start + 10 * row + np.arange(11)) % len(stream)
        np.testing.assert_array_equal(batch[row].numpy(), stream[idx])
    state = _roundtrip(src.state_dict())
    expected = src.next_batch(5, 10)
    restored = BinShardSource([first, second], vocab_size=2000, seed=0, shard_index=0, num_shards=1)
    restored.load_state_dict(state)
    assert torch.equal(expected, restored.next_batch(5, 10))


def test_bin_source_out_of_range_token_names_file(tmp_path):
    good = _write_bin(tmp_path / "good.bin", np.full(40, 3))
    bad = _write_bin(tmp_path / "bad.bin", np.full(40, 300))
    src = BinShardSource([good, bad], vocab_size=256, seed=0, shard_index=0)
    with pytest.raises(ValueError, match="bad.bin: token id 300"):
        for _ in range(10):  # the cyclic stream reaches bad.bin within two batches
            src.next_batch(2, 16)


def test_bin_source_shards_differ(tmp_path):
    path = _write_bin(tmp_path / "s.bin", np.random.default_rng(0).integers(0, 500, 4000))
    a = make_source("bin", paths=[path], vocab_size=500, seed=1, shard_index=0)
    b = make_source("bin", paths=[path], vocab_size=500, seed=1, shard_index=1)
    a2 = make_source("bin", paths=[path], vocab_size=500, seed=1, shard_index=0)
    ba = a.next_batch(2, 32)
    assert torch.equal(ba, a2.next_batch(2, 32)) and not torch.equal(ba, b.next_batch(2, 32))


# --- make_source errors ---

def test_make_source_kinds(tmp_path):
    text = tmp_path / "x.txt"
    text.write_text("hello world, hello swarm")
    assert isinstance(make_source("synthetic", paths=[], vocab_size=64, seed=0, shard_index=0), MarkovSource)
    assert isinstance(make_source("text", paths=[str(text)], vocab_size=256, seed=0, shard_index=0), TextFileSource)


@pytest.mark.parametrize(
    "kind, files, vocab, match",
    [
        ("parquet", [], 256, "data.source"),
        ("synthetic", ["x.txt"], 256, "data.paths"),
        ("text", [], 256, "data.paths"),
        ("bin", [], 256, "data.paths"),
        ("text", ["missing.txt"], 256, "missing.txt"),
        ("text", ["empty.txt"], 256, "empty.txt"),
        ("text", ["x.txt"], 32000, "vocab_size = 256"),
        ("bin", ["odd.bin"], 256, "odd.bin"),
        ("bin", ["ok.bin"], 70000, "vocab_size"),
    ],
)
def test_make_source_errors(tmp_path, kind, files, vocab, match):
    (tmp_path / "x.txt").write_text("some text")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    _write_bin(tmp_path / "ok.bin", [1, 2, 3])
    paths = [str(tmp_path / f) for f in files]
    with pytest.raises(ValueError, match=match):
        make_source(kind, paths=paths, vocab_size=vocab, seed=0, shard_index=0)


def test_corpus_shorter_than_window_raises(tmp_path):
    path = _write_bin(tmp_path / "short.bin", [1, 2, 3])
    with pytest.raises(ValueError, match="seq_len"):
        BinShardSource([path], vocab_size=10, seed=0).next_batch(1, 8)
