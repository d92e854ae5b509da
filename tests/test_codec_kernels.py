"""The codecs' numba CPU path (peer/outer/cpu_path.py, cpu_kernels.py) against their torch path, bit for bit.

Every codec, encode and decode: the same message bytes, the same decoded bits, the same errors, for property-
tested and edge-case inputs (zeros, signs, ties at E3M0 thresholds, subnormals, values near FLT_MAX, NaN/Inf,
sizes around the block sizes, empty), top-k ties (the same indices as torch.topk), hostile messages; and the
path's threading contract: concurrent calls, a forked child, one compiled signature per kernel, the fallback.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("numba")
# torch path everywhere: nothing to compare (the fallback has its own test below), and the fork test would hang in
# torch's OpenMP barrier, whose threads a forked child lacks
if os.environ.get("SWARMLOCO_NO_NUMBA") == "1":
    pytest.skip("SWARMLOCO_NO_NUMBA=1: no kernels to compare", allow_module_level=True)

from peer.outer import cpu_kernels, cpu_path  # noqa: E402
from peer.outer.codec import CodecError, make_codec  # noqa: E402
from peer.proto import codec_pb2  # noqa: E402

CODECS = ["e3m0", "fp8", "bf16", "topk32", "topk64", "topk128"]
THRESHOLDS = [0.5, 1.5, 3.0, 6.0, 12.0, 24.0, 48.0]
FLT_MAX = torch.finfo(torch.float32).max
FAST = {name: make_codec(name) for name in CODECS}
REF = {name: make_codec(name, cpu_kernels=False) for name in CODECS}


def test_the_kernels_compile_here():
    assert cpu_path.kernels() is not None


def _outcome(fn):
    try:
        return fn()
    except (ValueError, CodecError) as e:
        return (type(e), str(e))


def assert_same_encode(name: str, x: torch.Tensor) -> None:
    fast, ref = _outcome(lambda: FAST[name].encode_flat(x)), _outcome(lambda: REF[name].encode_flat(x))
    if isinstance(ref, tuple):
        assert fast == ref
        return
    assert fast.SerializeToString() == ref.SerializeToString(), name
    assert_same_decode(name, fast)


def assert_same_decode(name: str, msg: codec_pb2.EncodedTensor) -> None:
    """The kernels' and torch's decodes agree (values or error), into a new tensor and into a given one (filled
    with NaN first: every element must be written); what decodes is finite (``Codec.decode_flat``'s contract)."""
    fast, ref = _outcome(lambda: FAST[name].decode_flat(msg)), _outcome(lambda: REF[name].decode_flat(msg))
    if isinstance(ref, tuple):
        assert fast == ref
        return
    assert fast.dtype == ref.dtype == torch.float32 and fast.shape == ref.shape
    assert torch.equal(fast.view(torch.int32), ref.view(torch.int32)), name
    assert torch.isfinite(ref).all(), name
    for codec in (FAST[name], REF[name]):
        out = torch.full((msg.numel,), math.nan)
        assert codec.decode_flat(msg, out=out) is out
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), name


# ------------------------------------------------------------------------------------------ encode

any_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)  # subnormals and FLT_MAX included


@settings(max_examples=200, deadline=None)
@given(values=st.lists(any_f32, min_size=0, max_size=300), repeat=st.integers(1, 30),
       log_scale=st.integers(-140, 120), name=st.sampled_from(CODECS))
def test_encode_matches_torch_for_any_values(values, repeat, log_scale, name):
    x = torch.tensor(values * repeat, dtype=torch.float32)
    assert_same_encode(name, x)
    assert_same_encode(name, (x.double() * 2.0 ** log_scale).clamp(-FLT_MAX, FLT_MAX).float())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 129, 4095, 4096, 4097, 4096 + 33, 4096 + 129,
                               3 * 4096 - 1, 100_003])
def test_sizes_around_the_blocks(name, n):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.exp(torch.randn(n) * 4)
    assert_same_encode(name, x)
    assert_same_encode(name, torch.zeros(n))
    assert_same_encode(name, -torch.zeros(n))


@pytest.mark.parametrize("name", CODECS)
def test_special_values(name):
    torch.manual_seed(2)
    x = torch.randn(64 * 4096 + 17)
    x[:64] *= 1e-38  # subnormal e3m0 scale
    x[64:128] *= 1e-44  # absmax / 64 underflows to 0
    x[128:192] *= 3e36
    x[192] = FLT_MAX
    x[200:264] = -FLT_MAX
    x[300:364] = torch.finfo(torch.float32).smallest_normal
    x[400:464] = 1.4e-45  # the smallest subnormal
    x[500] = -0.0
    x[4096 * 3:4096 * 4] *= 1e-40
    x[4096 * 5:4096 * 6] = 0.0
    x[4096 * 6:4096 * 7] = torch.finfo(torch.float32).max * torch.rand(4096)
    assert_same_encode(name, x)
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 4095, x.numel() - 1):
            y = x.clone()
            y[at] = bad
            assert_same_encode(name, y)


def test_e3m0_ties_at_every_threshold():
    torch.manual_seed(0)
    x = torch.randn(4096, 64) * torch.exp(torch.randn(4096, 1) * 8)
    x[:300] *= 1e-35  # scales near and below the smallest normal
    s = x.abs().amax(1, keepdim=True) / 64
    for k, t in enumerate(THRESHOLDS):
        at = (t * s.double()).float()
        x[:, 1 + 3 * k] = at[:, 0]
        x[:, 2 + 3 * k] = -torch.nextafter(at, torch.zeros_like(at))[:, 0]
        x[:, 3 + 3 * k] = torch.nextafter(at, torch.full_like(at, math.inf))[:, 0]
    for name in ("e3m0", "topk32", "topk64", "topk128"):
        assert_same_encode(name, x.reshape(-1))


def test_fp8_rounding_of_a_sweep_of_float32_values():
    """Blocks whose absmax is 448 have scale 1: the codes are the e4m3fn rounding of the values themselves."""
    bits = torch.arange(0, 0x43E00000, 3331, dtype=torch.int64).to(torch.int32)  # every exponent, many mantissas
    x = bits.view(torch.float32)
    x = torch.cat([x, -x]).reshape(-1)
    pad = (-x.numel()) % 63
    x = torch.cat([x, torch.zeros(pad)]).reshape(-1, 63)
    x = torch.cat([torch.full((x.shape[0], 1), 448.0), x], 1).reshape(-1)
    assert_same_encode("fp8", x)


def test_fp8_rounding_at_every_tie():
    """Every e4m3fn rounding midpoint below 448 (normal and subnormal), and its float32 neighbours."""
    normal = [(e << 23) | (m << 20) | (1 << 19) for e in range(121, 136) for m in range(8)]
    subnormal = torch.tensor([(2 * k + 1) * 2.0 ** -10 for k in range(8)]).view(torch.int32).tolist()
    ties = torch.tensor(normal + subnormal, dtype=torch.int64)
    bits = torch.cat([ties - 1, ties, ties + 1]).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[x.abs() <= 448.0]
    x = torch.cat([x, -x])
    pad = (-x.numel()) % 63
    x = torch.cat([x, torch.zeros(pad)]).reshape(-1, 63)
    x = torch.cat([torch.full((x.shape[0], 1), 448.0), x], 1).reshape(-1)
    assert_same_encode("fp8", x)


def test_bf16_rounding_of_every_upper_half():
    """Every finite float32 upper half (sign, exponent, 7 mantissa bits) with the lower halves that decide the
    rounding: zero, just below, at and just above the tie, the largest; near FLT_MAX they round past the bf16 max
    and saturate. The kernel rounds the magnitude in int32 lanes; torch rounds the value."""
    upper = torch.arange(0, 1 << 16, dtype=torch.int64)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # exponent all ones: Inf and NaN, refused by both
    lower = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((upper[:, None] << 16) | lower[None, :]).reshape(-1)
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # (as signed int32 bits)
    assert torch.isfinite(x).all()
    assert_same_encode("bf16", x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", CODECS)
def test_other_dtypes_and_strides(name, dtype):
    torch.manual_seed(5)
    x = torch.randn(2 * 9000 + 1, dtype=torch.float64) * 1e3
    assert_same_encode(name, x.to(dtype))
    assert_same_encode(name, x.to(dtype)[::2])  # not contiguous


@pytest.mark.parametrize("name", ["topk32", "topk64", "topk128"])
@pytest.mark.parametrize("case", ["all_equal", "signs", "tie_at_k", "tie_below_k", "few_nonzero", "levels"])
def test_topk_ties_choose_torchs_indices(name, case):
    k = FAST[name].k
    g = torch.Generator().manual_seed(len(case) + k)
    x = torch.randn(5 * 4096 + 3000, generator=g)
    if case == "all_equal":
        x[:] = 0.5
    elif case == "signs":
        x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    elif case == "tie_at_k":  # k - 3 large values, then 7 equal ones: the k-th ties with ones left out
        for b in range(6):
            idx = torch.randperm(min(4096, x.numel() - b * 4096), generator=g)[:k + 4] + b * 4096
            x[idx[:k - 3]] = 10.0 + torch.rand(k - 3, generator=g)
            x[idx[k - 3:]] = -5.0
    elif case == "tie_below_k":  # equal values all inside the k largest: no choice to make
        x[::512] = 7.0
    elif case == "few_nonzero":
        x = torch.zeros_like(x)
        x[::1000] = torch.randn(x[::1000].shape, generator=g)
    else:  # few distinct magnitudes: ties everywhere
        x = torch.randint(-3, 4, x.shape, generator=g).float()
    assert_same_encode(name, x)
    assert_same_encode(name, x[:4096 * 2 + k + 1])


# ------------------------------------------------------------------------------------------ decode


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(CODECS), numel=st.integers(0, 9000), seed=st.integers(0, 2 ** 32 - 1),
       mode=st.sampled_from(["valid", "random_bytes", "bad_scale", "wrong_size"]))
def test_decode_matches_torch_for_hostile_messages(name, numel, seed, mode):
    g = torch.Generator().manual_seed(seed)
    msg = FAST[name].encode_flat(torch.randn(numel, generator=g) * 100)
    if mode == "random_bytes":
        if name.startswith("topk"):  # mostly rising indices, some not, some past the end
            raw = torch.randint(0, 1 << 16, (len(msg.data) // 2,), generator=g)
            if seed % 2:
                raw = raw.sort().values
            msg.data = struct.pack(f"<{raw.numel()}H", *raw.tolist())
        else:
            msg.data = bytes(torch.randint(0, 256, (len(msg.data),), generator=g, dtype=torch.uint8).tolist())
    elif mode == "bad_scale" and len(msg.scales):
        values = [math.nan, math.inf, -1.0, FLT_MAX, 1e-45, 0.0]
        at = 4 * int(torch.randint(0, len(msg.scales) // 4, (1,), generator=g))
        msg.scales = msg.scales[:at] + struct.pack("<f", values[seed % len(values)]) + msg.scales[at + 4:]
    elif mode == "wrong_size":
        msg.data = msg.data[:-1] if seed % 2 and msg.data else msg.data + b"\0"
    assert_same_decode(name, msg)


def test_topk_decode_rejects_what_torch_rejects():
    for name in ("topk32", "topk128"):
        k = FAST[name].k
        msg = FAST[name].encode_flat(torch.randn(4096 + 500))
        entries = list(struct.unpack(f"<{len(msg.data) // 2}H", msg.data))
        for at, value in [(5, entries[4]), (k, 0), (k + 3, 500 << 4), (2 * k - 1, 0xFFFF), (0, 0xFFF0)]:
            bad = codec_pb2.EncodedTensor()
            bad.CopyFrom(msg)
            e = list(entries)
            e[at] = value
            bad.data = struct.pack(f"<{len(e)}H", *e)
            assert_same_decode(name, bad)


def test_every_code_byte_decodes_as_torch_does():
    scales = [1.0, 3.0, 2.5e-39, 1e-45, 5.3e36, 0.0, 0.7, FLT_MAX / 448]
    every = bytes(range(256)) * 2
    e3m0 = codec_pb2.EncodedTensor(codec="e3m0", codec_version=1, numel=1024, block_size=64, data=every * 1,
                                   scales=struct.pack("<16f", *(scales * 2)))
    assert_same_decode("e3m0", e3m0)
    no_nan = bytes(b for b in range(256) if b & 0x7F != 0x7F)
    data = (no_nan * 3)[:64 * 8]
    fp8 = codec_pb2.EncodedTensor(codec="fp8", codec_version=1, numel=len(data), block_size=64, data=data,
                                  scales=struct.pack("<8f", *[min(v, FLT_MAX / 448) for v in scales]))
    assert_same_decode("fp8", fp8)


def test_kernels_refuse_arrays_smaller_than_their_range():
    import numpy as np
    # read-only wire buffers, as the wrappers pass them (so no kernel compiles a second signature)
    u8, f32, u16 = (np.frombuffer(bytes(n), t) for n, t in ((64, np.uint8), (8, np.float32), (16, np.uint16)))
    assert cpu_kernels.e3m0_decode(u8, f32, np.zeros(200, np.float32), 200, 0, 4) == 2  # 4 blocks, data for 2
    assert cpu_kernels.fp8_decode(u8, f32, np.zeros(128, np.float32), 128, 0, 2) == 2
    assert cpu_kernels.bf16_decode(u16, np.zeros(4, np.int32), 0, 8) == 2
    assert cpu_kernels.topk_decode(u16, f32, np.zeros(100, np.float32), 100, 32, 0, 2) == 2
    xi = np.zeros(5000, np.int32)
    assert cpu_kernels.e3m0_encode(xi, 5000, 0, 79, np.zeros(32 * 78, np.uint8), np.zeros(79, np.float32)) == 2
    assert cpu_kernels.topk_encode(xi, 5000, 32, 0, 2, np.zeros(63, np.uint16), np.zeros(2, np.float32),
                                   np.zeros(2, np.uint8)) == 2


# ------------------------------------------------------------------------------- threads, fork, JIT


def test_concurrent_calls_from_several_threads():
    torch.manual_seed(9)
    inputs = [torch.randn(600_000) * (i + 1) for i in range(6)]
    want = {(i, name): FAST[name].encode_flat(x).SerializeToString() for i, x in enumerate(inputs) for name in CODECS}
    got: dict = {}
    errors: list = []

    def work(i: int) -> None:
        try:
            for _ in range(2):
                for name in CODECS:
                    msg = FAST[name].encode_flat(inputs[i])
                    got[(i, name)] = msg.SerializeToString()
                    assert torch.equal(FAST[name].decode_flat(msg), REF[name].decode_flat(msg))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


def test_a_forked_child_encodes_the_same_bytes():
    x = torch.randn(700_000)
    want = FAST["e3m0"].encode_flat(x).SerializeToString()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own pool, the parent's compiled kernels
        ok = FAST["e3m0"].encode_flat(x).SerializeToString() == want
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0


def test_every_kernel_compiled_once():
    for name in CODECS:  # every wrapper has run by now in this module
        FAST[name].decode_flat(FAST[name].encode_flat(torch.randn(5000)))
    for fn in ("e3m0_encode", "e3m0_decode", "fp8_encode", "fp8_decode", "bf16_encode", "bf16_decode",
               "topk_encode", "topk_check", "topk_decode"):
        assert len(getattr(cpu_kernels, fn).signatures) == 1, fn


@pytest.mark.parametrize("how", ["env", "no_numba"])
def test_without_numba_the_torch_path_runs(how):
    code = ("import sys, torch\n"
            + ("sys.modules['numba'] = None\n" if how == "no_numba" else "")
            + "from peer.outer import cpu_path\nfrom peer.outer.codec import decode, encode\n"
              "x = torch.randn(5000)\nfor name in ('e3m0', 'fp8', 'bf16', 'topk32'):\n"
              "    assert decode(encode(x, name)).shape == x.shape\n"
              "assert cpu_path.kernels() is None\n")
    env = dict(os.environ, SWARMLOCO_NO_NUMBA="1" if how == "env" else "0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if how == "no_numba":
        assert run.stderr.count("numba kernels unavailable") == 1  # logged once
