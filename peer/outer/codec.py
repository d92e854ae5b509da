"""Wire codecs for outer gradients: tensor <-> ``EncodedTensor`` protobuf (protos/codec.proto).

:func:`encode` returns the message; :func:`decode` an fp32 tensor of the original shape, validating everything it
reads (messages come from untrusted peers: :class:`CodecError`). Codecs register in :data:`CODECS`; the name and
version (:func:`codec_key`) are part of the matchmaking key, so peers with different codecs never share a group.

Codecs (byte layouts: protos/codec.proto, docs/algorithm.md section 6): ``fp32``; ``bf16`` (round to nearest even,
saturating); ``fp8`` (e4m3fn, a float32 scale ``absmax / 448`` per block of 64); ``e3m0`` (FP4 in
``peer/outer/e3m0.py``: scale ``absmax / 64`` per block of 64, two codes per byte, exact round to nearest with ties
away from zero, optionally stochastic: ``make_codec("e3m0", stochastic_rounding=True)``); ``topk32/64/128`` (the k
largest of every 4096 elements, index and FP4 code in 16 bits: ``peer/outer/topk.py``; with error feedback).

Torch on the input's device; on the CPU, fused numba kernels with the same bytes (``peer/outer/cpu_path.py``).
Message bytes are on the host. The same bytes decode to bitwise identical tensors (the all-reduce relies on it).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from peer.outer import cpu_path
from peer.outer.e3m0 import E3M0Codec
from peer.outer.topk import TOPK_KS, TopKCodec
from peer.outer.wire import (_BF16_MAX, _FLT_MAX, _LITTLE, _Blocks, Codec, CodecError, _check_float, _check_scales,
                             _default_chunk, _host_buffer, _le_f32, _le_f32_bytes, _nonfinite_error, _read, _scratch,
                             _to_bytes, all_finite, check_out, into)
from peer.proto import codec_pb2

__all__ = ["CODECS", "SPARSE_CODECS", "Codec", "CodecError", "CodecLike", "E3M0Codec", "all_finite", "codec_key",
           "decode", "encode", "encode_span", "get_codec", "make_codec", "roundtrip"]


def _on_cpu(device: Optional[torch.device]) -> bool:
    return device is None or torch.device(device).type == "cpu"


# ------------------------------------------------------------------------------------------ fp32


class Fp32Codec:
    """No compression: little-endian IEEE-754 binary32, 4 bytes per element."""

    name, version, block_size = "fp32", 1, 1
    draws_random = False

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        data = flat.to(torch.float32)
        if not all_finite(data):
            raise _nonfinite_error()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=flat.numel(),
                                       data=_le_f32_bytes(data))

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        data, _ = _read(msg, self, block_size=0, data_len=4 * msg.numel, n_scales=0)
        dest = check_out(out, msg.numel)
        values = into(_le_f32(data), dest) if dest is not None else _le_f32(data).clone()  # (our own copy)
        if not all_finite(values):
            raise CodecError("fp32 piece has non-finite values")
        return values if dest is not None or device is None else values.to(device)


# ------------------------------------------------------------------------------------------ bf16


class Bf16Codec:
    """bfloat16 bits, little-endian, 2 bytes per element (round to nearest even, saturating)."""

    name, version, block_size = "bf16", 1, 1
    draws_random = False

    def __init__(self, chunk_elems: Optional[int] = None, cpu_kernels: bool = True):
        self.chunk_elems = chunk_elems
        self.cpu_kernels = cpu_kernels  # False: the torch path on the CPU too (the tests' reference)

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        n = flat.numel()
        fast = cpu_path.bf16_encode(flat) if self.cpu_kernels else None
        if fast is not None:
            return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=n, data=fast)
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
            if not all_finite(flat):
                raise _nonfinite_error()
            out.clamp_(-_BF16_MAX, _BF16_MAX)  # finite values that rounded to Inf saturate instead
        bits = out.view(torch.int16).cpu()
        data = bits.numpy().astype("<i2", copy=False).tobytes()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=n, data=data)

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        data, _ = _read(msg, self, block_size=0, data_len=2 * msg.numel, n_scales=0)
        out = check_out(out, msg.numel)
        if out is not None:
            device = None
        fast = cpu_path.bf16_decode(data, msg.numel, out) if self.cpu_kernels and _on_cpu(device) else None
        if fast is not None:
            return fast
        if _LITTLE:
            bits = _host_buffer(data, torch.int16)
        else:
            bits = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16))
        if device is not None:
            bits = bits.to(device)
        if bits.numel() and int((bits & 0x7FFF).amax()) >= 0x7F80:  # exponent all ones: Inf/NaN
            raise CodecError("bf16 piece has non-finite values")
        return into(bits.view(torch.bfloat16).to(torch.float32), out)


# ------------------------------------------------------------------------------------------- fp8


def _fp8_table() -> torch.Tensor:
    """float32 value of every e4m3fn byte (0x7F and 0xFF are NaN: decoders reject them; 0x80 -> +0.0)."""
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    table[0x80] = 0.0
    return table


class Fp8Codec:
    """float8 e4m3fn codes with one float32 scale ``absmax / 448`` per block of 64 elements."""

    name, version, block_size = "fp8", 1, 64
    draws_random = False
    MAX = 448.0

    def __init__(self, chunk_elems: Optional[int] = None, cpu_kernels: bool = True):
        self.chunk_elems = chunk_elems
        self.cpu_kernels = cpu_kernels  # False: the torch path on the CPU too (the tests' reference)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        fast = cpu_path.fp8_encode(flat) if self.cpu_kernels else None
        if fast is not None:
            return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=flat.numel(),
                                           block_size=self.block_size, data=fast[0], scales=fast[1])
        blocks = _Blocks(flat, self.block_size, self.chunk_elems)
        nb, dev = blocks.n_blocks, flat.device
        data = torch.empty(nb * self.block_size, dtype=torch.uint8, device=dev)
        scales = torch.empty(nb, dtype=torch.float32, device=dev)
        for b0, xc in blocks:
            nbc = xc.numel() // self.block_size
            x2 = xc.view(nbc, self.block_size)
            absmax = x2.abs().amax(1)
            # a tensor divisor: CUDA divides by a host scalar as a product with its rounded reciprocal, which
            # differs from the CPU's quotient in the last bit (the scales, hence the codes, must be identical)
            s = absmax / torch.full_like(absmax, self.MAX)
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

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        nb = -(-msg.numel // self.block_size)
        data, scale_bytes = _read(msg, self, block_size=self.block_size, data_len=nb * self.block_size, n_scales=nb)
        dest = check_out(out, msg.numel)
        dev = torch.device(device) if device is not None and dest is None else torch.device("cpu")
        codes = _host_buffer(data, torch.uint8).to(dev)
        scales = _le_f32(scale_bytes).to(dev)
        _check_scales(scales, _FLT_MAX / self.MAX, self.name)
        fast = cpu_path.fp8_decode(data, scale_bytes, msg.numel, dest) if self.cpu_kernels and _on_cpu(dev) else None
        if fast is not None:
            return fast
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
        return into(out[:msg.numel], dest)


# --------------------------------------------------------------------------------- registry & API

CODECS: dict[str, Codec] = {"fp32": Fp32Codec(), "bf16": Bf16Codec(), "fp8": Fp8Codec(), "e3m0": E3M0Codec(),
                            **{f"topk{k}": TopKCodec(k) for k in TOPK_KS}}
_FACTORIES: dict[str, Callable[..., Codec]] = {"fp32": Fp32Codec, "bf16": Bf16Codec, "fp8": Fp8Codec, "e3m0": E3M0Codec,
              **{f"topk{k}": functools.partial(TopKCodec, k) for k in TOPK_KS}}
SPARSE_CODECS = tuple(f"topk{k}" for k in TOPK_KS)  # they need error feedback (peer/outer/topk.py)

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


def encode_span(codec: Codec, flat: torch.Tensor, step: int) -> list[codec_pb2.EncodedTensor]:
    """``flat`` cut in consecutive pieces of ``step`` elements (a multiple of the codec's block size), each
    encoded: the same messages as ``codec.encode_flat`` of each slice. On the CPU the pieces are encoded on
    several threads, unless the codec draws random numbers (stochastic rounding: the draws' order would change)."""
    bounds = range(0, flat.numel(), step)
    if flat.device.type != "cpu" or codec.draws_random or len(bounds) < 2:
        return [codec.encode_flat(flat[off:off + step]) for off in bounds]
    out: list[Optional[codec_pb2.EncodedTensor]] = [None] * len(bounds)

    def one(i: int) -> None:
        out[i] = codec.encode_flat(flat[bounds[i]:bounds[i] + step])
    cpu_path.each(one, len(bounds))  # (every item runs, or an exception of one is raised here)
    done = [m for m in out if m is not None]
    assert len(done) == len(bounds), "a piece was not encoded"
    return done


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
    flat = codec.decode_flat(msg, device=None if device is None else torch.device(device))
    if flat.numel() != msg.numel:
        raise CodecError(f"decoded {flat.numel()} elements, header says {msg.numel}")
    return flat.reshape(shape)


def roundtrip(tensor: torch.Tensor, codec: CodecLike = "e3m0") -> torch.Tensor:
    """``decode(encode(tensor))`` on the tensor's device: what peers receive when we send ``tensor``
    (for error feedback). With stochastic rounding this is one random draw, not the one sent."""
    return decode(encode(tensor, codec), device=tensor.device)


def warm_up(codec: CodecLike) -> float:
    """Encodes and decodes a few blocks on the CPU, so that the codec's CPU kernels compile (or load from numba's
    cache) now and not in the first round, where the compile would hold the thread that serves the swarm for
    seconds. Returns the seconds it took."""
    t0 = time.perf_counter()
    roundtrip(torch.randn(2 * 4096 + 100, generator=torch.Generator().manual_seed(0)), codec)  # (a tail block too)
    return time.perf_counter() - t0


# -------------------------------------------------------------------------------- error feedback
