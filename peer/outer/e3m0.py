"""FP4 E3M0, the default wire codec (docs/algorithm.md section 6; byte layout in protos/codec.proto).

Sign + 3-bit exponent, no mantissa: codes 0..7 are 0, 1, 2, 4, ..., 64 block scales (``absmax / 64`` per
block of 64, float32), codes 8..15 their negatives; two codes per byte, the first element in the low nibble.
Round to nearest in the linear domain, ties away from zero, computed exactly on float32 bit patterns (no
float error at the thresholds); optional stochastic rounding (unbiased).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from peer.outer import cpu_path
from peer.outer.wire import (_FLT_MAX, _INF_BITS, _LITTLE, _Blocks, _check_float, _check_scales, _default_chunk,
                             _host_buffer, _le_f32, _le_f32_bytes, _nonfinite_error, _read, _scratch, _to_bytes,
                             check_out, into)
from peer.proto import codec_pb2

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
                 chunk_elems: Optional[int] = None, cpu_kernels: bool = True):
        self.stochastic_rounding = bool(stochastic_rounding)
        self.draws_random = self.stochastic_rounding
        self.cpu_kernels = cpu_kernels  # False: the torch path on the CPU too (the reference the tests compare)
        self.generator = generator
        self.chunk_elems = chunk_elems
        self._tables: dict[torch.device, torch.Tensor] = {}

    # ---- encode

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        fast = cpu_path.e3m0_encode(flat) if self.cpu_kernels and not self.stochastic_rounding else None
        if fast is not None:
            return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=flat.numel(),
                                           block_size=64, data=fast[0], scales=fast[1])
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

    def _kernels_for(self, dev: torch.device) -> bool:
        return self.cpu_kernels and dev.type == "cpu"

    def _pair_table(self, dev: torch.device) -> torch.Tensor:
        table = self._tables.get(dev)
        if table is None:
            # each row's two float32 values viewed as one 64-bit word: a 1-D gather of 8 bytes
            table = self._tables[dev] = e3m0_byte_table().view(torch.int64).view(256).to(dev)
        return table

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        nb = -(-msg.numel // 64)
        data_bytes, scale_bytes = _read(msg, self, block_size=64, data_len=32 * nb, n_scales=nb)
        dest = check_out(out, msg.numel)
        dev = torch.device(device) if device is not None and dest is None else torch.device("cpu")
        data = _host_buffer(data_bytes, torch.uint8).to(dev)
        scales = _le_f32(scale_bytes).to(dev)
        _check_scales(scales, _FLT_MAX / 64, self.name)  # so 64 * s (the largest magnitude) is finite
        fast = cpu_path.e3m0_decode(data_bytes, scale_bytes, msg.numel, dest) if self._kernels_for(dev) else None
        if fast is not None:
            return fast
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
        return into(out[:msg.numel], dest)


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
