"""Wire codecs (peer/outer/codec.py, protos/codec.proto, docs/algorithm.md section 6).

FP4 E3M0: code table, every rounding threshold and tie, signs, zero blocks, padding, nibble order,
validation of malformed messages, error statistics on Gaussian data, stochastic rounding, error
feedback, determinism, and property tests against the rounding rule. Also fp32/bf16/fp8.
"""

import math
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from peer.outer.codec import (CODECS, CodecError, E3M0Codec, all_finite, codec_key, decode, encode, encode_span,
                              get_codec, make_codec, roundtrip)
from peer.outer.e3m0 import e3m0_byte_table, e3m0_code_values, e3m0_reference_codes
from peer.outer.state import ErrorFeedback
from peer.proto import codec_pb2

ALL = ["fp32", "bf16", "fp8", "e3m0"]
SPARSE = ["topk32", "topk64", "topk128"]  # (their own tests: tests/test_topk.py)
LEVELS = [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
THRESHOLDS = [0.5, 1.5, 3.0, 6.0, 12.0, 24.0, 48.0]
FLT_MAX = torch.finfo(torch.float32).max


def codes_of(msg) -> list[int]:
    """Unpacks an e3m0 message's nibbles (low nibble first), padding included."""
    out = []
    for b in msg.data:
        out += [b & 15, b >> 4]
    return out


def scales_of(msg) -> list[float]:
    return list(struct.unpack(f"<{len(msg.scales) // 4}f", msg.scales))


def e3m0_msg(data: bytes, scales, numel: int, **kw):
    return codec_pb2.EncodedTensor(codec="e3m0", codec_version=1, numel=numel, block_size=64, data=data,
                                   scales=struct.pack(f"<{len(scales)}f", *scales), **kw)


def expected_code(x: float, s: float) -> int:
    """The rounding rule in float64 (exact for float32 inputs): count thresholds <= |x|/s."""
    e = 0 if s == 0 else sum(abs(x) / s >= t for t in THRESHOLDS)
    return e + (8 if math.copysign(1.0, x) < 0 else 0)


# ----------------------------------------------------------------------------- table and layout


def test_code_table():
    vals = e3m0_code_values()
    assert vals.tolist() == LEVELS + [0.0, -1.0, -2.0, -4.0, -8.0, -16.0, -32.0, -64.0]
    assert not torch.signbit(vals[8])  # code 8 (-0) decodes to +0.0
    table = e3m0_byte_table()
    assert table.shape == (256, 2) and table.dtype == torch.float32
    for b in range(256):
        assert table[b].tolist() == [vals[b & 15].item(), vals[b >> 4].item()]
    # decoding every byte with scale 1 gives exactly the table, low nibble first
    msg = e3m0_msg(bytes(range(256)), [1.0] * 8, 512)
    assert torch.equal(decode(msg), table.reshape(-1))


def test_nibble_order_hand_built_byte():
    # byte 0x9A: low nibble 0xA = code 10 (-2), high nibble 0x9 = code 9 (-1); byte 0x21: +1 then +2
    msg = e3m0_msg(bytes([0x9A, 0x21]) + bytes(30), [3.0], 4)
    assert decode(msg).tolist() == [-6.0, -3.0, 3.0, 6.0]
    enc = encode(torch.tensor([1.0, 2.0, -4.0, 64.0]), "e3m0")
    assert scales_of(enc) == [1.0] and len(enc.data) == 32
    assert enc.data[0] == 0x21 and enc.data[1] == (0x7 << 4 | 0xB)  # (+1, +2), (-4 = code 11, +64 = code 7)
    assert set(enc.data[2:]) == {0}


def test_sizes_and_tail_padding():
    for n in [1, 2, 63, 64, 65, 100, 127, 128, 129, 1000]:
        x = torch.randn(n)
        msg = encode(x, "e3m0")
        nb = math.ceil(n / 64)
        assert msg.numel == n and msg.block_size == 64
        assert len(msg.data) == nb * 32 and len(msg.scales) == nb * 4
        assert codes_of(msg)[n:] == [0] * (nb * 64 - n)  # padding encodes zeros
        # padding does not change the scale: the last block's scale is its real elements' absmax / 64
        assert scales_of(msg)[-1] == x[(nb - 1) * 64:].abs().max().item() / 64
        y = decode(msg)
        assert y.shape == (n,) and y.dtype == torch.float32


# -------------------------------------------------------------------------- rounding thresholds


@pytest.mark.parametrize("scale", [1.0, 1.0 + 2.0 ** -23, 0.7, 3.0e-20, 1.7e30])
def test_every_threshold_and_tie(scale):
    """Exactly at each threshold rounds away from zero; one ulp below rounds down, above up.
    Odd-mantissa scales (1 + 2^-23) make 1.5 s unrepresentable: the comparison must stay exact."""
    s = torch.tensor(scale, dtype=torch.float32)
    xs = [64 * s]  # the block's absmax: scale = absmax / 64 = s exactly
    for t in THRESHOLDS:
        at = torch.tensor(t * float(s), dtype=torch.float64).to(torch.float32)  # nearest float32 to t*s
        xs += [at, torch.nextafter(at, torch.tensor(0.0)), torch.nextafter(at, torch.tensor(math.inf))]
    x = torch.stack(xs)
    x = torch.cat([x, -x])
    msg = encode(x, "e3m0")
    assert scales_of(msg) == [float(s)]
    got = codes_of(msg)[:x.numel()]
    want = [expected_code(v, float(s)) for v in x.tolist()]
    assert got == want
    if scale == 1.0:  # exact ties: t * 1 is representable
        ties = got[1:22:3]
        assert ties == [1, 2, 3, 4, 5, 6, 7]  # 0.5 -> 1, 1.5 -> 2, 3 -> 4, ..., 48 -> 64
        below = got[2:22:3]
        assert below == [0, 1, 2, 3, 4, 5, 6]


def test_threshold_values_decode_to_nearest_level():
    x = torch.tensor([64.0, 0.49, 0.5, 1.49, 1.5, 2.99, 3.0, 5.99, 6.0, 11.9, 12.0, 23.9, 24.0, 47.9, 48.0, 63.0])
    y = decode(encode(x, "e3m0"))
    assert y.tolist() == [64.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0, 32.0, 64.0, 64.0]
    assert decode(encode(-x, "e3m0")).tolist() == [-v if v else 0.0 for v in y.tolist()]


def test_negative_zero_and_zero_blocks():
    x = torch.zeros(200)
    x[5] = -0.0
    x[64:128] = torch.randn(64)  # block 1 nonzero, blocks 0, 2, 3 all zero (one has -0.0)
    x[130] = -0.0
    msg = encode(x, "e3m0")
    sc = scales_of(msg)
    assert sc[0] == 0.0 and sc[2] == 0.0 and sc[3] == 0.0 and sc[1] > 0
    codes = codes_of(msg)
    assert codes[5] in (0, 8) and set(codes[:64]) <= {0, 8}
    y = decode(msg)
    assert not torch.signbit(y[:64]).any() and not torch.signbit(y[128:]).any()  # +0.0, never -0.0
    assert torch.equal(y[:64], torch.zeros(64)) and torch.equal(y[128:], torch.zeros(72))
    # code 8 (-0) decodes to +0.0 even with a nonzero scale
    y8 = decode(e3m0_msg(bytes([0x88]) + bytes(31), [2.0], 2))
    assert y8.tolist() == [0.0, 0.0] and not torch.signbit(y8).any()
    # a tiny negative value that rounds to zero decodes to +0.0 too
    y = decode(encode(torch.tensor([64.0, -0.1]), "e3m0"))
    assert y[1].item() == 0.0 and not torch.signbit(y[1])


def test_tiny_and_huge_scales_match_the_exact_reference():
    torch.manual_seed(3)
    x = torch.randn(64 * 8)
    x[:64] *= 1e-38  # subnormal scale: exact float64 path
    x[64:128] *= 1e-44  # absmax / 64 underflows to 0 -> all zero
    x[128:192] *= 3e36  # absmax near FLT_MAX / 100
    x[192] = FLT_MAX  # the largest finite value
    x[256:320] *= 1e-30
    msg = encode(x, "e3m0")
    codes, s = e3m0_reference_codes(x.view(-1, 64))
    assert codes_of(msg) == codes.view(-1).tolist()
    assert scales_of(msg) == s.tolist()
    y = decode(msg)
    assert torch.isfinite(y).all()
    assert y[192].item() == FLT_MAX  # 64 * (absmax / 64) = absmax exactly
    assert torch.equal(y[64:128], torch.zeros(64))


def test_fast_path_matches_exact_reference_with_ties():
    torch.manual_seed(0)
    n_blocks = 4096
    x = torch.randn(n_blocks, 64) * torch.exp(torch.randn(n_blocks, 1) * 8)
    s = x.abs().amax(1, keepdim=True) / 64
    for k, t in enumerate(THRESHOLDS):  # plant exact ties and their float32 neighbours
        at = (t * s.double()).float()
        x[:, 1 + 3 * k] = at[:, 0]
        x[:, 2 + 3 * k] = -torch.nextafter(at, torch.zeros_like(at))[:, 0]
        x[:, 3 + 3 * k] = torch.nextafter(at, torch.full_like(at, math.inf))[:, 0]
    x[::7] = 0.0
    msg = encode(x, "e3m0")
    codes, scales = e3m0_reference_codes(x)
    assert bytes(msg.data) == _pack(codes.view(-1))
    assert scales_of(msg) == scales.tolist()


def _pack(codes: torch.Tensor) -> bytes:
    c = codes.to(torch.int64).view(-1, 2)
    return bytes((c[:, 0] | (c[:, 1] << 4)).to(torch.uint8).tolist())


def test_chunking_and_streaming_do_not_change_bytes():
    torch.manual_seed(1)
    x = torch.randn(64 * 50 + 17)
    whole = encode(x, "e3m0")
    for chunk in (64, 128, 64 * 7):
        alt = E3M0Codec(chunk_elems=chunk).encode_flat(x)
        assert alt.data == whole.data and alt.scales == whole.scales
    # pieces starting at multiples of block_size (as the all-reduce streams them) tile the same bytes
    codec = get_codec("e3m0")
    pieces = [codec.encode_flat(x[off:off + 640]) for off in range(0, x.numel(), 640)]
    assert b"".join(p.data for p in pieces) == whole.data
    assert b"".join(p.scales for p in pieces) == whole.scales
    assert torch.equal(torch.cat([codec.decode_flat(p) for p in pieces]), decode(whole))


# ------------------------------------------------------------------------- round trip and shapes


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(), (1,), (0,), (7,), (3, 5, 7), (2, 64), (129,), (4, 1, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_shapes_and_dtypes(name, shape, dtype):
    torch.manual_seed(2)
    x = torch.randn(shape).to(dtype)
    msg = encode(x, name)
    msg2 = codec_pb2.EncodedTensor.FromString(msg.SerializeToString())
    y = decode(msg2)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert msg.codec == name and msg.codec_version == 1
    if x.numel():
        rel = float((y - x.float()).norm() / x.float().norm().clamp_min(1e-30))
        assert rel <= {"fp32": 0.0, "bf16": 0.01, "fp8": 0.07, "e3m0": 0.5}[name]
        if name == "fp32" or (name == "bf16" and dtype == torch.bfloat16):
            assert torch.equal(y, x.float())


@pytest.mark.parametrize("name", ALL + SPARSE)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 70, -1])
def test_non_finite_input_is_rejected(name, bad, where):
    x = torch.randn(100)
    x[where] = bad
    with pytest.raises(ValueError, match="non-finite"):
        encode(x, name)
    with pytest.raises(ValueError):
        get_codec(name).encode_flat(x)


def test_rejects_non_float_input():
    with pytest.raises(ValueError):
        encode(torch.arange(10), "e3m0")


# ------------------------------------------------------------------------------ malformed input


def _good(name="e3m0", n=100):
    return encode(torch.randn(n), name)


def _mutated(msg, **fields):
    m = codec_pb2.EncodedTensor()
    m.CopyFrom(msg)
    for k, v in fields.items():
        if k == "shape":
            del m.shape[:]
            m.shape.extend(v)
        else:
            setattr(m, k, v)
    return m


@pytest.mark.parametrize("name", ["e3m0", "fp8"])
def test_malformed_block_messages_are_rejected(name):
    good = _good(name)
    decode(good)
    bad_messages = [
        _mutated(good, data=good.data[:-1]),  # short data
        _mutated(good, data=good.data + b"\0"),  # long data
        _mutated(good, data=b""),
        _mutated(good, scales=good.scales[:-4]),  # wrong number of scales
        _mutated(good, scales=good.scales + b"\0\0\0\0"),
        _mutated(good, scales=good.scales[:-1]),
        _mutated(good, numel=good.numel + 64, shape=[]),  # numel vs data
        _mutated(good, block_size=32),
        _mutated(good, block_size=0),
        _mutated(good, codec="e3m1"),  # unknown codec
        _mutated(good, codec=""),
        _mutated(good, codec_version=2),  # unknown version
        _mutated(good, codec_version=0),
    ]
    limit = FLT_MAX / (64 if name == "e3m0" else 448)
    for bad_scale in [math.nan, math.inf, -math.inf, -1.0, limit * 1.01]:
        bad_messages.append(_mutated(good, scales=struct.pack("<f", bad_scale) + good.scales[4:]))
    for m in bad_messages:
        with pytest.raises(CodecError):
            decode(m)
        if m.codec == name and m.codec_version == 1:
            with pytest.raises(CodecError):
                get_codec(name).decode_flat(m)
    for m in (_mutated(good, shape=[3, 3]), _mutated(good, scalar=True)):  # header vs numel: decode() checks
        with pytest.raises(CodecError):
            decode(m)
    # the largest legal scale still decodes to finite values
    decode(_mutated(good, scales=struct.pack("<f", limit * 0.999) + good.scales[4:]))


def test_malformed_fp8_bf16_fp32_payloads():
    fp8 = _good("fp8")
    for nan_code in (0x7F, 0xFF):
        with pytest.raises(CodecError):
            decode(_mutated(fp8, data=bytes([nan_code]) + fp8.data[1:]))
    bf16 = _good("bf16", 10)
    for pattern in (0x7F80, 0xFF80, 0x7FC0, 0x7F81):  # +Inf, -Inf, NaN
        with pytest.raises(CodecError):
            decode(_mutated(bf16, data=struct.pack("<H", pattern) + bf16.data[2:]))
    for m in (_mutated(bf16, data=bf16.data[:-1]), _mutated(bf16, scales=b"\0\0\0\0"), _mutated(bf16, block_size=64)):
        with pytest.raises(CodecError):
            decode(m)
    fp32 = _good("fp32", 10)
    with pytest.raises(CodecError):
        decode(_mutated(fp32, data=struct.pack("<f", math.nan) + fp32.data[4:]))
    with pytest.raises(CodecError):
        decode(_mutated(fp32, data=fp32.data[:-2]))
    with pytest.raises(CodecError):
        decode(_good("e3m0", 1000), max_numel=999)


def test_registry_and_keys():
    assert set(CODECS) == set(ALL + SPARSE)
    assert codec_key("e3m0") == "e3m0v1" and codec_key("fp32") == "fp32v1" and codec_key("topk32") == "topk32v1"
    assert codec_key(make_codec("e3m0", stochastic_rounding=True)) == "e3m0v1"
    for name in ALL + SPARSE:
        c = get_codec(name)
        assert c.name == name and c.version == 1 and c.block_size in (1, 64, 4096)
    assert get_codec("e3m0").block_size == 64 and get_codec("fp8").block_size == 64
    with pytest.raises(ValueError):
        get_codec("fp4")
    with pytest.raises(ValueError):
        make_codec("e3m0", rounding="up")
    with pytest.raises(ValueError):
        make_codec("nope")


# ------------------------------------------------------------------------------- error statistics


def test_gaussian_error_statistics():
    torch.manual_seed(0)
    x = torch.randn(1 << 20)
    y = decode(encode(x, "e3m0"))
    rel = float((y - x).norm() / x.norm())
    cos = float(torch.dot(x.double(), y.double()) / (x.double().norm() * y.double().norm()))
    assert 0.17 <= rel <= 0.21, rel
    assert cos >= 0.97, cos
    msg = encode(x, "e3m0")
    assert len(msg.data) + len(msg.scales) == x.numel() * 4.5 / 8  # 4.5 bits per element
    for name, limit in (("bf16", 0.005), ("fp8", 0.04)):
        yy = decode(encode(x, name))
        assert float((yy - x).norm() / x.norm()) < limit, name


def test_fp8_matches_torch_cast_and_saturates():
    torch.manual_seed(5)
    x = torch.randn(64 * 10) * 5
    msg = encode(x, "fp8")
    s = torch.tensor(scales_of(msg))
    ref = (x.view(-1, 64) / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1)
    assert bytes(msg.data) == bytes(ref.tolist())
    y = decode(msg)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(y, (table[ref.long()].view(-1, 64) * s[:, None]).view(-1) + 0.0)
    big = torch.tensor([FLT_MAX, -FLT_MAX, 1.0])
    yb = decode(encode(big, "fp8"))
    assert torch.isfinite(yb).all() and yb[0] > 0.9 * FLT_MAX and yb[1] < -0.9 * FLT_MAX


def test_bf16_saturates_instead_of_overflowing():
    x = torch.tensor([FLT_MAX, -FLT_MAX, 1.0])
    y = decode(encode(x, "bf16"))
    assert torch.isfinite(y).all() and y[0] == torch.finfo(torch.bfloat16).max


# ---------------------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_off_by_default_and_unbiased():
    assert not get_codec("e3m0").stochastic_rounding
    torch.manual_seed(0)
    x = torch.randn(4096)
    assert encode(x, "e3m0").data == encode(x, "e3m0").data  # deterministic default
    codec = make_codec("e3m0", stochastic_rounding=True, generator=torch.Generator().manual_seed(7))
    assert codec.name == "e3m0" and codec.version == 1
    draws = torch.stack([decode(encode(x, codec)) for _ in range(400)])
    # every draw is one of the two neighbouring levels of |x|/s
    s = torch.tensor(scales_of(encode(x, "e3m0"))).repeat_interleave(64)[:x.numel()]
    units = draws / s
    assert torch.isin(units.abs(), torch.tensor(LEVELS)).all()
    mean = draws.mean(0)
    err = mean - x
    # unbiased: the mean's error shrinks like 1/sqrt(draws) (deterministic rounding: ~0.19)
    assert float(err.norm() / x.norm()) < 0.03
    # and no systematic drift in any direction: signed mean error per unit of scale is ~0
    assert abs(float((err / s).mean())) < 0.01
    one_draw = float((draws[0] - x).norm() / x.norm())
    assert 0.15 < one_draw < 0.4
    # reproducible with the same generator seed
    c1 = make_codec("e3m0", stochastic_rounding=True, generator=torch.Generator().manual_seed(1))
    c2 = make_codec("e3m0", stochastic_rounding=True, generator=torch.Generator().manual_seed(1))
    assert encode(x, c1).data == encode(x, c2).data


def test_stochastic_rounding_exact_levels_stay_put():
    codec = make_codec("e3m0", stochastic_rounding=True, generator=torch.Generator().manual_seed(0))
    x = torch.tensor([64.0, 32.0, -16.0, 8.0, 4.0, -2.0, 1.0, 0.0] * 8)
    for _ in range(20):
        assert torch.equal(decode(encode(x, codec)), x)


# ---------------------------------------------------------------------------------- error feedback


def test_error_feedback_residual_semantics():
    torch.manual_seed(0)
    ef = ErrorFeedback()
    d0 = torch.randn(1000)
    assert ef.compensate(d0) is d0  # no residual yet: delta unchanged
    sent_total = torch.zeros(1000)
    delta_total = torch.zeros(1000)
    for _ in range(5):
        delta = torch.randn(1000)
        x = ef.compensate(delta)
        assert torch.allclose(x, delta + (ef.residual if ef.residual is not None else 0))
        dec = roundtrip(x, "e3m0")
        r = ef.update(x, dec)
        assert torch.equal(r, x - dec) and torch.equal(ef.residual, x - dec)
        sent_total += dec
        delta_total += delta
    # telescoping: everything not yet delivered is exactly the current residual
    assert torch.allclose(sent_total + ef.residual, delta_total, atol=1e-5)
    state = ef.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert torch.equal(other.residual, ef.residual)
    state["residual"].zero_()  # the state is a copy
    assert not torch.equal(other.residual, state["residual"])
    other.reset()
    assert other.residual is None and other.state_dict() == {"residual": None}
    with pytest.raises(ValueError):
        ef.compensate(torch.zeros(10))
    with pytest.raises(ValueError):
        ef.update(torch.zeros(3), torch.zeros(4))


# ---------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", ALL + SPARSE)
def test_decode_is_deterministic(name):
    torch.manual_seed(4)
    msg = encode(torch.randn(5000) * 3, name)
    raw = msg.SerializeToString()
    a = decode(codec_pb2.EncodedTensor.FromString(raw))
    b = decode(codec_pb2.EncodedTensor.FromString(raw))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert encode(a, name).SerializeToString() == encode(b, name).SerializeToString()


@pytest.mark.parametrize("name", ALL + SPARSE)
def test_a_span_encodes_to_the_messages_of_its_pieces(name):
    """encode_span (several threads on the CPU) gives each piece's own encoding, in order, the tail included; a
    stochastic codec encodes its pieces one after the other, drawing as a loop over them would."""
    torch.manual_seed(8)
    x = torch.randn(9 * 4096 + 70) * 5
    step = 2 * 4096
    want = [get_codec(name).encode_flat(x[o:o + step]).SerializeToString() for o in range(0, x.numel(), step)]
    assert [m.SerializeToString() for m in encode_span(get_codec(name), x, step)] == want
    if name == "e3m0":
        def stochastic():
            return make_codec("e3m0", stochastic_rounding=True, generator=torch.Generator().manual_seed(3))
        seq = stochastic()
        want = [seq.encode_flat(x[o:o + step]).SerializeToString() for o in range(0, x.numel(), step)]
        assert [m.SerializeToString() for m in encode_span(stochastic(), x, step)] == want


@pytest.mark.parametrize("name", ALL + SPARSE)
def test_decoding_into_a_buffer_checks_it_first(name):
    msg = encode(torch.randn(300), name)
    for bad in (torch.empty(299), torch.empty(300, dtype=torch.float64), torch.empty(600)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            get_codec(name).decode_flat(msg, out=bad)
    out = torch.empty(300)
    assert get_codec(name).decode_flat(msg, out=out) is out
    assert torch.equal(out, decode(msg))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ALL + SPARSE)
def test_cuda_matches_cpu(name):
    torch.manual_seed(6)
    x = torch.randn(100_003) * 2
    cpu = encode(x, name)
    gpu = encode(x.cuda(), name)
    assert gpu.data == cpu.data and gpu.scales == cpu.scales
    assert torch.equal(decode(cpu, device="cuda").cpu(), decode(cpu))


# ----------------------------------------------------------------------------- property tests

finite_f32 = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(finite_f32, min_size=1, max_size=300),
       log_scale=st.floats(min_value=-60, max_value=60),
       special=st.sampled_from(["none", "ties", "zero_block"]))
def test_e3m0_properties(values, log_scale, special):
    x = torch.tensor(values, dtype=torch.float32) * float(2.0 ** log_scale)
    x = x.clamp(-1e30, 1e30)
    if special == "ties" and x.numel() > 8 and x.abs().max() > 0:
        s = float(x[:64].abs().max()) / 64
        for i, t in enumerate(THRESHOLDS):
            x[1 + i] = float(torch.tensor(t * s).float()) * (-1) ** i
    if special == "zero_block":
        x[:64] = 0.0
    msg = encode(x, "e3m0")
    y = decode(msg)
    n = x.numel()
    nb = math.ceil(n / 64)
    assert len(msg.data) == 32 * nb and len(msg.scales) == 4 * nb
    s = torch.tensor(scales_of(msg)).repeat_interleave(64)[:n].double()
    xd, yd = x.double(), y.double()
    # decoded magnitudes are in the code set times the block scale
    units = torch.where(s > 0, yd.abs() / s, torch.zeros_like(yd))
    assert torch.isin(units, torch.tensor(LEVELS, dtype=torch.float64)).all()
    # the sign is preserved, or the value decodes to zero
    assert ((torch.sign(yd) == torch.sign(xd)) | (yd == 0)).all()
    # the error is within the rounding rule's bound: half the gap to the neighbouring level
    bound = 0.5 * torch.maximum(s, yd.abs())
    normal = s >= 2.0 ** -126  # a subnormal scale (absmax < 2^-120) is itself rounded
    assert ((xd - yd).abs() <= bound)[normal].all()
    # the codes are exactly the rounding rule
    assert codes_of(msg)[:n] == [expected_code(v, sc) for v, sc in zip(x.tolist(), s.tolist())]
    # decoding is a projection: encoding the decoded values again gives the same values and bytes
    msg2 = encode(y, "e3m0")
    assert torch.equal(decode(msg2), y)
    assert msg2.scales == msg.scales


@settings(max_examples=60, deadline=None)
@given(values=st.lists(finite_f32, min_size=1, max_size=200), log_scale=st.floats(min_value=-40, max_value=40),
       name=st.sampled_from(["fp8", "bf16", "fp32"]))
def test_other_codecs_properties(values, log_scale, name):
    x = (torch.tensor(values, dtype=torch.float32) * float(2.0 ** log_scale)).clamp(-1e30, 1e30)
    y = decode(encode(x, name))
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()
    if name == "fp8":  # 3 mantissa bits: relative error <= 2^-4, subnormal step 2^-9 of the scale
        nb = math.ceil(x.numel() / 64)
        s = torch.tensor(scales_of(encode(x, name))).repeat_interleave(64)[:x.numel()].double()
        # + 1e-40: a block whose absmax is subnormal has a scale (absmax/448) that underflows to 0
        bound = 2.0 ** -4 * x.double().abs() + 2.0 ** -10 * s + 1e-40
        assert ((y.double() - x.double()).abs() <= bound * (1 + 1e-6)).all()
        assert nb == len(encode(x, name).scales) // 4
    else:  # bf16 and fp32 are projections
        assert torch.equal(decode(encode(y, name)), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_isfinite_all(dtype):
    """The one-reduction finiteness check (min and max propagate NaN) says what ``isfinite(x).all()`` says."""
    big = torch.finfo(dtype).max
    x = torch.linspace(-1, 1, 10_001, dtype=torch.float64).to(dtype)
    cases = [x, x[::3], torch.empty(0, dtype=dtype), torch.tensor([big, -big, -0.0], dtype=dtype)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 5_000, 10_000):
            y = x.clone()
            y[at] = bad
            cases += [y, y.view(1, -1).t()]
    for case in cases:
        assert all_finite(case) == bool(torch.isfinite(case).all()), case
