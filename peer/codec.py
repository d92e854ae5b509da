"""Wire codecs for outer gradients: tensor <-> ``EncodedTensor`` protobuf (protos/codec.proto).

``encode(tensor, codec)`` returns the message; ``decode(message)`` returns an fp32 tensor of the
original shape. Decoding validates everything it reads (codec, version, sizes, scales), because
messages come from untrusted peers, and raises :class:`CodecError`. Codecs register in
:data:`CODECS`; the codec name and version (:func:`codec_key`) are part of the matchmaking key so
peers with different codecs never share a group.

Codecs (byte layouts: protos/codec.proto, docs/algorithm.md section 6):

- ``fp32`` v1: raw little-endian binary32.
- ``bf16`` v1: raw little-endian bfloat16 bits (round to nearest even; saturates at the bf16 max).
- ``fp8``  v1: float8 e4m3fn codes, one little-endian float32 scale ``absmax / 448`` per block of 64.
- ``e3m0`` v1: FP4 E3M0 (sign + 3-bit exponent, no mantissa), scale ``absmax / 64`` per block of
  64, two codes per byte (first element in the low nibble). Round to nearest in the linear domain,
  ties away from zero, computed *exactly* (no float error at the thresholds); optional stochastic
  rounding (``make_codec("e3m0", stochastic_rounding=True)``).

Everything is vectorized torch and runs on the input's device (CPU or CUDA); large inputs are
processed in chunks into preallocated buffers. The message bytes are always on the host. Decoding
is deterministic: the same bytes give bitwise identical tensors (the all-reduce relies on it).

:class:`ErrorFeedback` keeps the residual ``x - decode(encode(x))`` of a lossy codec (one per
fragment, owned by the trainer; off by default).
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from typing import Optional, Protocol, Sequence, Union

import numpy as np
import torch

from peer.proto import codec_pb2


class CodecError(ValueError):
    """A message that cannot be decoded (malformed, wrong size, unknown codec, non-finite values)."""


class Codec(Protocol):
    name: str
    version: int
    block_size: int  # pieces of a stream must start at multiples of this many elements

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor: ...

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None) -> torch.Tensor: ...


_FLT_MAX = float(torch.finfo(torch.float32).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_INF_BITS = 0x7F800000  # bit pattern of +inf: |x| bits >= this <=> x is not finite
_LITTLE = sys.byteorder == "little"
_CPU_CHUNK = 1 << 18  # elements per chunk on CPU: the temporaries (~10 bytes/element) stay in cache
_GPU_CHUNK = 1 << 24


# --------------------------------------------------------------------------------------- helpers


def _host_buffer(buf: bytes, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy read-only view of message bytes (never written to)."""
    if not buf:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read it
        return torch.frombuffer(buf, dtype=dtype)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().numpy().tobytes()


def _le_f32_bytes(t: torch.Tensor) -> bytes:
    arr = t.detach().to("cpu", torch.float32).contiguous().numpy()
    return (arr if _LITTLE else arr.astype("<f4")).tobytes()


def _le_f32(buf: bytes) -> torch.Tensor:
    if _LITTLE:
        return _host_buffer(buf, torch.float32)
    return torch.from_numpy(np.frombuffer(buf, dtype="<f4").astype(np.float32))


_local = threading.local()


def _scratch(key: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A temporary of n elements. On CPU it is reused across calls (per thread; the codec functions
    never yield, so one call at a time uses it): fresh large buffers cost page faults on every call.
    On CUDA the caching allocator already reuses memory."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    cache = getattr(_local, "buffers", None)
    if cache is None:
        cache = _local.buffers = {}
    buf = cache.get((key, dtype))
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        if n <= 4 * _CPU_CHUNK:  # keep chunk-sized buffers only
            cache[(key, dtype)] = buf
    return buf[:n]


def _default_chunk(device: torch.device) -> int:
    return _GPU_CHUNK if device.type == "cuda" else _CPU_CHUNK


def _check_float(flat: torch.Tensor) -> torch.Tensor:
    if not flat.is_floating_point():
        raise ValueError(f"encode: expected a floating-point tensor, got {flat.dtype}")
    return flat.detach().reshape(-1)


def _nonfinite_error() -> ValueError:
    return ValueError("encode: tensor has non-finite values (NaN/Inf are never put on the wire)")


def _read(msg: codec_pb2.EncodedTensor, codec: "Codec", *, block_size: int, data_len: int,
          n_scales: int) -> tuple[bytes, bytes]:
    """Checks the sizes in the header; returns (data, scales) bytes (each read once: a copy)."""
    if msg.block_size != block_size:
        raise CodecError(f"{codec.name} piece has block_size {msg.block_size}, expected {block_size}")
    data, scales = msg.data, msg.scales
    if len(data) != data_len:
        raise CodecError(f"{codec.name} piece has {len(data)} data bytes for {msg.numel} elements "
                         f"(expected {data_len})")
    if len(scales) != 4 * n_scales:
        raise CodecError(f"{codec.name} piece has {len(scales)} scale bytes for {msg.numel} elements "
                         f"(expected {4 * n_scales})")
    return data, scales


def _check_scales(scales: torch.Tensor, max_scale: float, name: str) -> None:
    if scales.numel() and not bool(((scales >= 0) & (scales <= max_scale)).all()):
        raise CodecError(f"{name} piece has a negative, non-finite or out-of-range scale")


class _Blocks:
    """Walks a flat tensor in chunks of whole 64-element blocks, as contiguous float32 on its device;
    the tail chunk is zero-padded to a whole block."""

    def __init__(self, flat: torch.Tensor, block: int, chunk_elems: Optional[int]):
        self.flat, self.block = flat, block
        self.n = flat.numel()
        self.n_blocks = -(-self.n // block)
        chunk = chunk_elems or _default_chunk(flat.device)
        self.chunk = max(block, chunk - chunk % block)

    def __iter__(self):
        for start in range(0, self.n, self.chunk):
            xc = self.flat[start:start + self.chunk]
            if xc.numel() % self.block:
                padded = torch.zeros(-(-xc.numel() // self.block) * self.block, dtype=torch.float32,
                                     device=xc.device)
                padded[:xc.numel()] = xc
                xc = padded
            else:
                xc = xc.to(torch.float32).contiguous()
            yield start // self.block, xc


# ------------------------------------------------------------------------------------------ fp32


class Fp32Codec:
    """No compression: little-endian IEEE-754 binary32, 4 bytes per element."""

    name, version, block_size = "fp32", 1, 1

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        data = flat.to(torch.float32)
        if not bool(torch.isfinite(data).all()):
            raise _nonfinite_error()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=flat.numel(),
                                       data=_le_f32_bytes(data))

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None) -> torch.Tensor:
        data, _ = _read(msg, self, block_size=0, data_len=4 * msg.numel, n_scales=0)
        out = _le_f32(data).clone()  # our own writable copy
        if not bool(torch.isfinite(out).all()):
            raise CodecError("fp32 piece has non-finite values")
        return out.to(device) if device is not None else out


# ------------------------------------------------------------------------------------------ bf16


class Bf16Codec:
    """bfloat16 bits, little-endian, 2 bytes per element (round to nearest even, saturating)."""

    name, version, block_size = "bf16", 1, 1

    def __init__(self, chunk_elems: Optional[int] = None):
        self.chunk_elems = chunk_elems

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        n = flat.numel()
        out = torch.empty(n, dtype=torch.bfloat16, device=flat.device)
        chunk = self.chunk_elems or _default_chunk(flat.device)
        n_chunks = -(-n // chunk)
        peaks = torch.zeros(max(n_chunks, 1), dtype=torch.int16, device=flat.device)
        tmp = _scratch("a", min(chunk, n), torch.int16, flat.device)
        for k, start in enumerate(range(0, n, chunk)):
            yc = out[start:start + chunk]
            yc.copy_(flat[start:start + chunk])  # round to nearest even
            t = torch.bitwise_and(yc.view(torch.int16), 0x7FFF, out=tmp[:yc.numel()])
            peaks[k] = t.amax()  # >= 0x7F80: Inf/NaN in the input, or a finite value beyond the bf16 max
        if n and int(peaks.max()) >= 0x7F80:
            if not bool(torch.isfinite(flat).all()):
                raise _nonfinite_error()
            out.clamp_(-_BF16_MAX, _BF16_MAX)  # finite values that rounded to Inf saturate instead
        bits = out.view(torch.int16).cpu()
        data = bits.numpy().astype("<i2", copy=False).tobytes()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=n, data=data)

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None) -> torch.Tensor:
        data, _ = _read(msg, self, block_size=0, data_len=2 * msg.numel, n_scales=0)
        if _LITTLE:
            bits = _host_buffer(data, torch.int16)
        else:
            bits = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16))
        if device is not None:
            bits = bits.to(device)
        if bits.numel() and int((bits & 0x7FFF).amax()) >= 0x7F80:  # exponent all ones: Inf/NaN
            raise CodecError("bf16 piece has non-finite values")
        return bits.view(torch.bfloat16).to(torch.float32)


# ------------------------------------------------------------------------------------------- fp8


def _fp8_table() -> torch.Tensor:
    """float32 value of every e4m3fn byte (0x7F and 0xFF are NaN: decoders reject them; 0x80 -> +0.0)."""
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    table[0x80] = 0.0
    return table


class Fp8Codec:
    """float8 e4m3fn codes with one float32 scale ``absmax / 448`` per block of 64 elements."""

    name, version, block_size = "fp8", 1, 64
    MAX = 448.0

    def __init__(self, chunk_elems: Optional[int] = None):
        self.chunk_elems = chunk_elems
        self._tables: dict[torch.device, torch.Tensor] = {}

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        blocks = _Blocks(flat, self.block_size, self.chunk_elems)
        nb, dev = blocks.n_blocks, flat.device
        data = torch.empty(nb * self.block_size, dtype=torch.uint8, device=dev)
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        for b0, xc in blocks:
            nbc = xc.numel() // self.block_size
            x2 = xc.view(nbc, self.block_size)
            absmax = x2.abs().amax(1)
            s = absmax / self.MAX
            # absmax near FLT_MAX: step s down one ulp so that 448 * s stays finite (Inf/NaN stay)
            s = torch.where(torch.isinf(s * self.MAX) & torch.isfinite(s), torch.nextafter(s, torch.zeros_like(s)), s)
            scales[b0:b0 + nbc] = s
            y = x2 / torch.where(s > 0, s, torch.ones_like(s))[:, None]
            y.clamp_(-self.MAX, self.MAX)
            data[b0 * self.block_size:(b0 + nbc) * self.block_size].view(torch.float8_e4m3fn).copy_(y.view(-1))
        if nb and not bool(torch.isfinite(scales).all()):
            raise _nonfinite_error()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=blocks.n,
                                       block_size=self.block_size, data=_to_bytes(data),
                                       scales=_le_f32_bytes(scales))

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None) -> torch.Tensor:
        nb = -(-msg.numel // self.block_size)
        data, scale_bytes = _read(msg, self, block_size=self.block_size, data_len=nb * self.block_size, n_scales=nb)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        codes = _host_buffer(data, torch.uint8).to(dev)
        scales = _le_f32(scale_bytes).to(dev)
        _check_scales(scales, _FLT_MAX / self.MAX, self.name)
        table = self._tables.get(dev)
        if table is None:
            table = self._tables[dev] = _fp8_table().to(dev)
        out = torch.empty(nb * self.block_size, dtype=torch.float32, device=dev)
        chunk = _default_chunk(dev)
        idx = _scratch("a", min(chunk, out.numel()), torch.int32, dev)
        tmp = _scratch("b", idx.numel(), torch.uint8, dev)
        peaks = torch.zeros(max(1, -(-out.numel() // chunk)), dtype=torch.uint8, device=dev)
        for k, start in enumerate(range(0, out.numel(), chunk)):
            c = codes[start:start + chunk]
            peaks[k] = torch.bitwise_and(c, 0x7F, out=tmp[:c.numel()]).amax()  # 0x7F: a NaN code
            i = idx[:c.numel()]
            i.copy_(c)
            o = out[start:start + c.numel()]
            torch.index_select(table, 0, i, out=o)
            b0, b1 = start // self.block_size, (start + c.numel()) // self.block_size
            o.view(-1, self.block_size).mul_(scales[b0:b1, None])
        if out.numel() and int(peaks.max()) == 0x7F:
            raise CodecError("fp8 piece has NaN codes (0x7F or 0xFF)")
        return out[:msg.numel]


# ------------------------------------------------------------------------------------------ e3m0

E3M0_LEVELS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # magnitude of exponent field e, in scales
E3M0_THRESHOLDS = (0.5, 1.5, 3.0, 6.0, 12.0, 24.0, 48.0)  # |x|/s >= THRESHOLDS[k] <=> e >= k + 1
_E3M0_TINY = 2.0 ** -100  # blocks with 0 < absmax below this take the exact float64 path


def e3m0_code_values() -> torch.Tensor:
    """float32 value (in units of the block scale) of each of the 16 codes; code 8 (-0) is +0.0."""
    mag = torch.tensor(E3M0_LEVELS, dtype=torch.float32)
    vals = torch.cat([mag, -mag])
    vals[8] = 0.0
    return vals


def e3m0_byte_table() -> torch.Tensor:
    """The 256-entry decode table: byte -> (value of the low nibble, value of the high nibble)."""
    vals = e3m0_code_values()
    b = torch.arange(256)
    return torch.stack([vals[b & 15], vals[b >> 4]], dim=1).contiguous()


def e3m0_reference_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact reference encoder (float64, slow, used for tiny blocks and by the tests).

    ``x``: finite float32 of shape (n_blocks, 64). Returns (codes uint8 (n_blocks, 64), scales float32)."""
    x = x.to(torch.float32)
    s = x.abs().amax(1) / 64
    u = x.abs().to(torch.float64) / torch.where(s > 0, s, torch.ones_like(s)).to(torch.float64)[:, None]
    thresholds = torch.tensor(E3M0_THRESHOLDS, dtype=torch.float64, device=x.device)
    e = torch.bucketize(u, thresholds, right=True)  # how many thresholds are <= u: ties go up
    e = torch.where((s > 0)[:, None], e, torch.zeros_like(e))
    codes = e + 8 * torch.signbit(x).to(e.dtype)
    return codes.to(torch.uint8), s


def _pack_nibbles(codes: torch.Tensor, out: torch.Tensor, tmp16: Optional[torch.Tensor] = None) -> None:
    """codes (uint8, values 0..15, even length) -> out[i] = codes[2i] | codes[2i+1] << 4."""
    if _LITTLE:
        v = codes.view(torch.int16)  # low byte = first code, high byte = second code
        p = torch.bitwise_right_shift(v, 4, out=tmp16) if tmp16 is not None else v >> 4
        p |= v
        p &= 0xFF
        out.copy_(p)
    else:
        pair = codes.view(-1, 2)
        torch.bitwise_left_shift(pair[:, 1], 4, out=out)
        out |= pair[:, 0]


class E3M0Codec:
    """FP4 E3M0 with one float32 scale ``absmax / 64`` per block of 64 elements (docs/algorithm.md 6)."""

    name, version, block_size = "e3m0", 1, 64

    def __init__(self, stochastic_rounding: bool = False, generator: Optional[torch.Generator] = None,
                 chunk_elems: Optional[int] = None):
        self.stochastic_rounding = bool(stochastic_rounding)
        self.generator = generator
        self.chunk_elems = chunk_elems
        self._tables: dict[torch.device, torch.Tensor] = {}

    # ---- encode

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        blocks = _Blocks(flat, 64, self.chunk_elems)
        nb, dev = blocks.n_blocks, flat.device
        data = torch.empty(nb * 32, dtype=torch.uint8, device=dev)
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        ws = _Workspace(min(blocks.chunk, nb * 64), dev)
        kernel = self._encode_stochastic if self.stochastic_rounding else _e3m0_encode_chunk
        for b0, xc in blocks:
            nbc = xc.numel() // 64
            kernel(xc, data[b0 * 32:(b0 + nbc) * 32], scales[b0:b0 + nbc], ws)
        if nb:
            if not bool(torch.isfinite(scales).all()):
                raise _nonfinite_error()
            if not self.stochastic_rounding:
                _e3m0_fix_tiny_blocks(blocks, data, scales)
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=blocks.n,
                                       block_size=64, data=_to_bytes(data), scales=_le_f32_bytes(scales))

    def _encode_stochastic(self, xc: torch.Tensor, data_out: torch.Tensor, scale_out: torch.Tensor,
                           ws: "_Workspace") -> None:
        """Rounds |x|/s up to the next level with probability (u - lo) / (hi - lo): unbiased."""
        nbc = xc.numel() // 64
        x2 = xc.view(nbc, 64)
        a = x2.abs()
        s = a.amax(1) / 64
        scale_out.copy_(s)
        u = a.div_(torch.where(s > 0, s, torch.full_like(s, math.inf))[:, None]).clamp_(max=64.0)
        _, exp = torch.frexp(u)  # u = m * 2^exp, m in [0.5, 1): u in [2^(exp-1), 2^exp)
        lo_e = exp.clamp_(0, 7)  # the level at or below u (0 for u < 1)
        one = torch.ones_like(u)
        lo = torch.where(lo_e > 0, torch.ldexp(one, lo_e - 1), torch.zeros_like(u))
        hi = torch.ldexp(one, lo_e)
        p = (u - lo).div_(hi - lo)
        r = torch.rand(u.shape, generator=self.generator, device=xc.device, dtype=torch.float32)
        e = (lo_e + (r < p).to(lo_e.dtype)).clamp_(max=7)
        e += torch.signbit(x2).to(e.dtype) * 8
        _pack_nibbles(e.view(-1).to(torch.uint8), data_out)

    # ---- decode

    def _pair_table(self, dev: torch.device) -> torch.Tensor:
        table = self._tables.get(dev)
        if table is None:
            # each row's two float32 values viewed as one 64-bit word: a 1-D gather of 8 bytes
            table = self._tables[dev] = e3m0_byte_table().view(torch.int64).view(256).to(dev)
        return table

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None) -> torch.Tensor:
        nb = -(-msg.numel // 64)
        data_bytes, scale_bytes = _read(msg, self, block_size=64, data_len=32 * nb, n_scales=nb)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        data = _host_buffer(data_bytes, torch.uint8).to(dev)
        scales = _le_f32(scale_bytes).to(dev)
        _check_scales(scales, _FLT_MAX / 64, self.name)  # so 64 * s (the largest magnitude) is finite
        table = self._pair_table(dev)
        out = torch.empty(nb * 64, dtype=torch.float32, device=dev)
        chunk = _default_chunk(dev)  # elements per chunk
        idx = _scratch("a", min(chunk, nb * 64) // 2, torch.int32, dev)
        pairs = _scratch("b", idx.numel(), torch.int64, dev)
        for start in range(0, nb * 64, chunk):
            d = data[start // 2:(start + chunk) // 2]
            m = d.numel()
            i, p = idx[:m], pairs[:m]
            i.copy_(d)
            torch.index_select(table, 0, i, out=p)
            b0 = start // 64
            torch.mul(p.view(torch.float32).view(-1, 64), scales[b0:b0 + m // 32, None],
                      out=out[start:start + 2 * m].view(-1, 64))
        return out[:msg.numel]


class _Workspace:
    """Temporaries of one chunk, reused by every chunk (and, on CPU, across calls)."""

    def __init__(self, n: int, dev: torch.device):
        n = max(n, 64)
        self.i32a = _scratch("a", n, torch.int32, dev)
        self.i32b = _scratch("b", n, torch.int32, dev)
        self.u8 = _scratch("c", n, torch.uint8, dev)
        self.i16 = _scratch("d", n // 2, torch.int16, dev)


def _e3m0_encode_chunk(xc: torch.Tensor, data_out: torch.Tensor, scale_out: torch.Tensor, ws: _Workspace) -> None:
    """Deterministic round-to-nearest (ties away from zero), exact, on float32 bit patterns.

    With s = absmax/64 (exact for normal absmax), thresholds are 0.5s and 1.5s * 2^k (k = 0..5).
    H = 0.5s (exact) and T = RU(1.5s) (float32 rounded toward +inf) make ``|x| >= H`` and
    ``|x| >= 2^k T`` exact float32 comparisons. Non-negative float32 compare like their int32 bit
    patterns, and for normal T, ``(bits|x| - bits(T/4)) >> 23 = floor(log2(|x|/T)) + 2``, which is
    the exponent field e for |x| >= T/2. So e = max(that, [bits|x| >= bits H]). Blocks with
    0 < absmax < 2^-100 (subnormal scales) are recomputed afterwards by the exact float64 path.
    """
    n = xc.numel()
    nbc = n // 64
    xb = xc.view(torch.int32)
    a = torch.bitwise_and(xb, 0x7FFFFFFF, out=ws.i32a[:n])  # |x| as int32 bits
    a2 = a.view(nbc, 64)
    amax_bits = a2.amax(1)
    torch.div(amax_bits.view(torch.float32), 64, out=scale_out)  # NaN/Inf propagate: checked by caller
    zero = scale_out == 0
    # all-zero blocks (and blocks whose absmax/64 underflows to 0: they decode to zeros) get
    # thresholds above every finite |x|, so all their codes are 0 (8 for negative values)
    s_bits = scale_out.view(torch.int32)
    half_m1 = (s_bits - ((1 << 23) + 1)).masked_fill_(zero, _INF_BITS)  # bits(s/2) - 1 (s normal)
    t64 = scale_out.to(torch.float64) * 1.5  # exact
    t32 = t64.to(torch.float32)
    t_quarter = t32.view(torch.int32) + (t32.to(torch.float64) < t64)  # bits of RU(1.5 s): +1 ulp if rounded down
    t_quarter.sub_(2 << 23).masked_fill_(zero, _INF_BITS)  # bits(RU(1.5 s) / 4)
    ge_half = torch.sub(a2, half_m1[:, None], out=ws.i32b[:n].view(nbc, 64)).clamp_(0, 1)  # |x| >= H
    a2.sub_(t_quarter[:, None]).bitwise_right_shift_(23)  # floor(log2(|x|/T)) + 2
    torch.maximum(a2, ge_half, out=a2)  # exponent field e in 0..7
    minus = torch.bitwise_right_shift(xb, 31, out=ws.i32b[:n])  # -1 where the sign bit is set, else 0
    a.sub_(minus, alpha=8)  # code = e + 8 * sign bit
    codes = ws.u8[:n]
    codes.copy_(a)
    _pack_nibbles(codes, data_out, ws.i16[:n // 2])


def _e3m0_fix_tiny_blocks(blocks: _Blocks, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Re-encodes blocks with 0 < absmax < 2^-100 (subnormal scale) with the exact float64 path."""
    tiny = (scales > 0) & (scales < _E3M0_TINY / 64)
    if not bool(tiny.any()):
        return
    idx = tiny.nonzero().view(-1)  # sorted
    flat, n = blocks.flat, blocks.n
    full = n // 64  # complete blocks; a partial tail block (if any) has index `full`
    rows = flat[:full * 64].view(-1, 64)[idx[idx < full]].to(torch.float32)
    if n % 64 and int(idx[-1]) == full:
        tail = torch.zeros(1, 64, dtype=torch.float32, device=flat.device)
        tail[0, :n - full * 64] = flat[full * 64:]
        rows = torch.cat([rows, tail])
    codes, s = e3m0_reference_codes(rows)
    packed = torch.empty(idx.numel() * 32, dtype=torch.uint8, device=flat.device)
    _pack_nibbles(codes.view(-1).contiguous(), packed)
    data.view(-1, 32)[idx] = packed.view(-1, 32)
    scales[idx] = s


# --------------------------------------------------------------------------------- registry & API

CODECS: dict[str, Codec] = {"fp32": Fp32Codec(), "bf16": Bf16Codec(), "fp8": Fp8Codec(), "e3m0": E3M0Codec()}
_FACTORIES = {"fp32": Fp32Codec, "bf16": Bf16Codec, "fp8": Fp8Codec, "e3m0": E3M0Codec}

CodecLike = Union[str, Codec]


def get_codec(name: CodecLike) -> Codec:
    """The default (deterministic) instance of a codec; a codec instance is returned as is."""
    if not isinstance(name, str):
        return name
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(CODECS)}") from None


def make_codec(name: str, **options) -> Codec:
    """A codec instance with options, e.g. ``make_codec("e3m0", stochastic_rounding=True,
    generator=torch.Generator().manual_seed(0))``. Options change how values are encoded, never
    the byte format (so name and version, hence the matchmaking key, stay the same)."""
    get_codec(name)
    try:
        return _FACTORIES[name](**options)
    except TypeError as e:
        raise ValueError(f"codec {name!r} does not take options {sorted(options)}: {e}") from None


def codec_key(name: CodecLike) -> str:
    """Codec name and version, as used in matchmaking keys (e.g. ``e3m0v1``)."""
    codec = get_codec(name)
    return f"{codec.name}v{codec.version}"


def encode(tensor: torch.Tensor, codec: CodecLike = "e3m0") -> codec_pb2.EncodedTensor:
    """Encodes a whole tensor (any shape, floating dtype, CPU or CUDA); non-finite values raise
    ``ValueError``. The message records the shape (``scalar`` for a 0-d tensor)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"encode: expected a floating-point tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    msg = get_codec(codec).encode_flat(tensor.detach().reshape(-1))
    msg.shape.extend(tensor.shape)
    msg.scalar = tensor.dim() == 0
    return msg


def decode(msg: codec_pb2.EncodedTensor, *, max_numel: int = 1 << 31,
           device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """Decodes a message into an fp32 tensor of its shape (on ``device``, default CPU); raises
    :class:`CodecError` if the message is invalid. Same bytes -> bitwise identical result."""
    codec = CODECS.get(msg.codec)
    if codec is None:
        raise CodecError(f"unknown codec {msg.codec!r}")
    if msg.codec_version != codec.version:
        raise CodecError(f"{msg.codec} version {msg.codec_version} is not supported (have {codec.version})")
    if msg.numel > max_numel:
        raise CodecError(f"piece of {msg.numel} elements exceeds the bound {max_numel}")
    if msg.scalar:
        if len(msg.shape) or msg.numel != 1:
            raise CodecError("a scalar message must have numel 1 and an empty shape")
        shape: Sequence[int] = ()
    else:
        shape = tuple(msg.shape) or (msg.numel,)
        if math.prod(shape) != msg.numel:
            raise CodecError(f"shape {tuple(shape)} does not match numel {msg.numel}")
    flat = codec.decode_flat(msg, device=device)
    if flat.numel() != msg.numel:
        raise CodecError(f"decoded {flat.numel()} elements, header says {msg.numel}")
    return flat.reshape(shape)


def roundtrip(tensor: torch.Tensor, codec: CodecLike = "e3m0") -> torch.Tensor:
    """``decode(encode(tensor))`` on the tensor's device: what peers receive when we send ``tensor``
    (for error feedback). With stochastic rounding this is one random draw, not the one sent."""
    return decode(encode(tensor, codec), device=tensor.device)


# -------------------------------------------------------------------------------- error feedback


class ErrorFeedback:
    """Residual of a lossy codec for one fragment (off by default; the trainer owns one per fragment).

    Each round: ``x = ef.compensate(delta)`` (delta + residual), send ``x``, then
    ``ef.update(x, decoded_x)`` with ``decoded_x`` what the peers will decode from our bytes (for a
    deterministic codec ``roundtrip(x, codec)``). The residual ``x - decoded_x`` is added to the next
    round's delta, so quantization errors are delayed instead of lost.
    """

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None

    def compensate(self, delta: torch.Tensor) -> torch.Tensor:
        if self.residual is None:
            return delta
        if self.residual.shape != delta.shape:
            raise ValueError(f"error feedback residual has shape {tuple(self.residual.shape)}, "
                             f"delta has {tuple(delta.shape)}")
        return delta + self.residual.to(device=delta.device, dtype=delta.dtype)

    def update(self, sent: torch.Tensor, decoded_sent: torch.Tensor) -> torch.Tensor:
        if sent.shape != decoded_sent.shape:
            raise ValueError(f"sent {tuple(sent.shape)} and decoded {tuple(decoded_sent.shape)} differ in shape")
        residual = sent.detach().to(torch.float32) - decoded_sent.detach().to(device=sent.device, dtype=torch.float32)
        if not bool(torch.isfinite(residual).all()):
            raise ValueError("error feedback residual is not finite")
        self.residual = residual
        return residual

    def reset(self) -> None:
        self.residual = None

    def state_dict(self) -> dict:
        return {"residual": None if self.residual is None else self.residual.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        residual = state.get("residual")
        self.residual = None if residual is None else residual.detach().to(torch.float32).clone()
