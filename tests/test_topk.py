"""Top-k sparse codecs (peer/outer/topk.py, protos/codec.proto): what is selected and how it is coded (property tests
against the rule), sizes, malformed messages, error feedback, and the config rule that they need it."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from peer.config import ConfigError, PeerConfig
from peer.outer.aggregate import MAX_WEIGHT
from peer.outer.codec import SPARSE_CODECS, CodecError, decode, encode, get_codec, roundtrip
from peer.outer.e3m0 import e3m0_reference_codes
from peer.outer.state import ErrorFeedback
from peer.outer.topk import BLOCK, entries_for
from peer.proto import codec_pb2
from test_aggregate import ATTACKS, assert_bounded_influence, attack, honest_parts

finite_f32 = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


def _entries(msg) -> list[tuple[int, int]]:
    return [(e >> 4, e & 15) for (e,) in struct.iter_unpack("<H", msg.data)]


@settings(max_examples=80, deadline=None)
@given(values=st.lists(finite_f32, min_size=1, max_size=300), repeat=st.integers(1, 40),
       name=st.sampled_from(SPARSE_CODECS), special=st.sampled_from(["none", "ties", "zeros"]))
def test_the_k_largest_of_every_block_are_sent_as_fp4_codes(values, repeat, name, special):
    x = torch.tensor(values * repeat, dtype=torch.float32)  # up to 12,000 elements: whole and partial blocks
    if special == "ties":
        x = x.sign() * x.abs().max()  # every element of a block equally large
    if special == "zeros":
        x[: min(BLOCK, x.numel())] = 0.0
    k, n = get_codec(name).k, x.numel()
    msg = encode(x, name)
    assert len(msg.data) == 2 * entries_for(n, k) and len(msg.scales) == 4 * math.ceil(n / BLOCK)
    y = decode(msg)
    entries = _entries(msg)
    for b, start in enumerate(range(0, n, BLOCK)):
        block, sent = x[start:start + BLOCK], entries[b * k:(b + 1) * k]
        index = [i for i, _ in sent]
        assert index == sorted(set(index)) and len(index) == min(k, block.numel())  # rising, inside the block
        chosen = block.abs()[index]
        others = torch.ones(block.numel(), dtype=torch.bool)
        others[index] = False
        assert not others.any() or chosen.min() >= block.abs()[others].max()  # the k largest (any among ties)
        codes, scale = e3m0_reference_codes(block[index].view(1, -1))
        assert [c for _, c in sent] == codes.view(-1).tolist()  # E3M0's rounding against absmax / 64
        assert scale.item() == (block.abs().max() / 64).item()
        rest = torch.ones(block.numel(), dtype=torch.bool)
        rest[index] = False
        assert not y[start:start + BLOCK][rest].any()  # nothing else is decoded
    # decoding is a projection: the decoded vector encodes to itself
    assert torch.equal(decode(encode(y, name)), y)


def test_topk32_is_more_than_30_times_smaller_than_fp4():
    x = torch.randn(1 << 20)
    fp4, sparse = encode(x, "e3m0").ByteSize(), encode(x, "topk32").ByteSize()
    assert fp4 / sparse > 30, (fp4, sparse)
    assert all(encode(x, n).ByteSize() < encode(x, m).ByteSize() for n, m in zip(SPARSE_CODECS, SPARSE_CODECS[1:]))


def _mutated(msg, **fields):
    m = codec_pb2.EncodedTensor()
    m.CopyFrom(msg)
    for key, value in fields.items():
        setattr(m, key, value)
    return m


@pytest.mark.parametrize("name", SPARSE_CODECS)
def test_malformed_messages_are_rejected(name):
    torch.manual_seed(1)
    good = encode(torch.randn(BLOCK + 100), name)  # a whole block and a partial one of 100
    decode(good)
    k = get_codec(name).k
    words = list(struct.unpack(f"<{len(good.data) // 2}H", good.data))
    swapped = words[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]  # indices no longer rising
    repeated = words[:]
    repeated[1] = (repeated[0] >> 4 << 4) | (repeated[1] & 15)  # one position twice
    past = words[:]
    past[-1] = (150 << 4) | (past[-1] & 15)  # past the partial block's 100 elements
    pack = lambda w: struct.pack(f"<{len(w)}H", *w)  # noqa: E731
    bad = [_mutated(good, data=good.data[:-2]), _mutated(good, data=good.data + b"\0\0"), _mutated(good, data=b""),
           _mutated(good, scales=good.scales[:-4]), _mutated(good, scales=good.scales + b"\0" * 4),
           _mutated(good, block_size=64), _mutated(good, numel=good.numel + BLOCK), _mutated(good, codec_version=2),
           _mutated(good, data=pack(swapped)), _mutated(good, data=pack(repeated)), _mutated(good, data=pack(past))]
    for scale in (math.nan, math.inf, -1.0, torch.finfo(torch.float32).max / 64 * 1.01):
        bad.append(_mutated(good, scales=struct.pack("<f", scale) + good.scales[4:]))
    for m in bad:
        with pytest.raises(CodecError):
            decode(m)
    assert k in (32, 64, 128)


def test_with_error_feedback_nothing_is_lost_only_delayed():
    """SparseLoCo's recipe: what a round does not send is carried into the next; over rounds, what was delivered
    plus the residual is exactly what was meant to be sent, and a steady direction gets through."""
    torch.manual_seed(2)
    ef, delta = ErrorFeedback(), torch.randn(3 * BLOCK)
    delivered, cos = torch.zeros_like(delta), []
    for r in range(1, 257):
        x = ef.compensate(delta)
        got = roundtrip(x, "topk32")
        ef.update(x, got)
        delivered += got
        torch.testing.assert_close(delivered + ef.residual, r * delta, rtol=1e-4, atol=1e-2)
        cos.append(float(torch.nn.functional.cosine_similarity(delivered, delta, dim=0)))
    # 32 of 4096 a round: each element's turn comes about every 128 rounds (measured: cos 0.26 after one round,
    # 0.78 after 40, 0.94 after 128, 0.985 after 256)
    assert cos[0] < cos[39] < cos[127] < cos[255] and cos[255] > 0.97, cos[::32]


def test_a_sparse_codec_without_error_feedback_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="outer.error_feedback: must be true with outer.codec = topk32"):
        PeerConfig.from_dict({"outer": {"codec": "topk32"}})
    assert PeerConfig.from_dict({"outer": {"codec": "topk32", "error_feedback": True}}).outer.codec == "topk32"


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(SPARSE_CODECS), numel=st.integers(0, 3 * BLOCK), data=st.binary(max_size=1024),
       scales=st.binary(max_size=16), block_size=st.sampled_from([BLOCK, 0, 64, 4095]), valid_start=st.booleans())
def test_any_message_decodes_to_its_numel_or_is_refused(name, numel, data, scales, block_size, valid_start):
    """A hostile peer's bytes: a CodecError or a finite tensor of the size the header says, nothing else."""
    if valid_start:  # sizes right, contents arbitrary: the index and scale checks must hold
        count = entries_for(numel, get_codec(name).k)
        data = (data * (2 * count // max(len(data), 1) + 1))[:2 * count] if data else bytes(2 * count)
        scales = (scales + bytes(4 * math.ceil(numel / BLOCK)))[:4 * math.ceil(numel / BLOCK)]
    msg = codec_pb2.EncodedTensor(codec=name, codec_version=1, numel=numel, block_size=block_size, data=data,
                                  scales=scales)
    try:
        out = get_codec(name).decode_flat(msg)
    except CodecError:
        return
    assert out.shape == (numel,) and bool(torch.isfinite(out).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n_honest=st.integers(2, 7), kind=st.sampled_from(ATTACKS),
       lie=st.sampled_from([1.0, 1e6, MAX_WEIGHT]), name=st.sampled_from(SPARSE_CODECS))
def test_the_robust_rule_keeps_its_bound_with_sparse_parts(seed, n_honest, kind, lie, name):
    """The reducer aggregates what it decodes: with sparse parts (two blocks each, a few percent of their entries
    nonzero, on differing positions) one arbitrary part still moves the result at most the dense rule's bound."""
    honest = [roundtrip(p, name) for p in honest_parts(seed, n_honest, 2 * BLOCK, spread=0.3)]
    assert_bounded_influence(honest, roundtrip(attack(kind, honest, seed), name), lie)
