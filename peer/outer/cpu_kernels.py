"""numba kernels of the CPU path: the codecs' (:mod:`peer.outer.cpu_path` runs them) and the outer step's
(:mod:`peer.outer.cpu_fused`); importing this compiles nothing.

Each kernel does one codec's (or outer step's) whole per-element work in one pass over a range of blocks
``[b0, b1)``, so that several threads can share one call (``nogil``). Contract: the results are those of the torch
reference in ``codec.py``/``e3m0.py``/``topk.py``/``state.py`` for every input; float arithmetic is IEEE
float32/float64 exactly as there (no fastmath). Inputs are 1-D C-contiguous arrays sized by the caller; every index
read from the wire is bounds-checked again here, so a kernel never reads or writes outside its arrays. Kernels
return a flag instead of raising (1: a non-finite input or a NaN code; 2: arrays too small for the range, which the
callers' sizes rule out; topk_check: 1 falling indices, 2 an index past its block).
Array indices are uint64: numba then emits no negative-index wraparound, which would stop vectorization.
numba widens int32 arithmetic to int64; hot per-element helpers cast each step back to int32 so that their
loops vectorize in 32-bit lanes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic


def _cache_usable() -> bool:
    """numba caches next to this file, else in the user's cache dir; where neither is writable it refuses
    ``cache=True`` outright, and the kernels then compile in every process instead."""
    try:
        njit(cache=True)(lambda: 0)
        return True
    except RuntimeError:
        return False


_jit = njit(nogil=True, cache=_cache_usable(), error_model="numpy", boundscheck=False)
_jit_held = njit(nogil=False, cache=_cache_usable(), error_model="numpy", boundscheck=False)

ABS = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)
NO_THRESHOLD = np.int32(0x7FFFFFFF)  # above every finite |x|: codes of a zero-scale block are all 0 (or 8)
E3M0_VALUES = np.array([0, 1, 2, 4, 8, 16, 32, 64, 0, -1, -2, -4, -8, -16, -32, -64], dtype=np.float32)
F32_64, F32_448, F32_ONE = np.float32(64.0), np.float32(448.0), np.float32(1.0)
F32_DENORM = np.float32(2.0 ** 14)  # bits 141 << 23: c10's e4m3fn subnormal rounding constant
F32_2M9 = np.float32(2.0 ** -9)  # the e4m3fn subnormal step
U1, U2, U15, U16, U32, U64, U4096 = (np.uint64(v) for v in (1, 2, 15, 16, 32, 64, 4096))


@intrinsic
def f2i(typingctx, x):
    """The bits of a float32 as int32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def i2f(typingctx, x):
    """The float32 of int32 bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@_jit
def _ru32(p):
    """Bits of the smallest float32 >= p (0 < p < FLT_MAX)."""
    f = np.float32(p)
    return np.int32(f2i(f) + np.int32(np.float64(f) < p))


@_jit
def _e3m0_thresholds(s):
    """th_j = bits of RU32(t_j * s), t = 0.5, 1.5, 3, ..., 48: for float32 a >= 0, a >= t_j s <=> bits(a) >= th_j."""
    if s == 0:
        t = NO_THRESHOLD
        return (t, t, t, t, t, t, t)
    d = np.float64(s)  # t_j * d is exact: 2 significant bits times 24
    return (_ru32(0.5 * d), _ru32(1.5 * d), _ru32(3.0 * d), _ru32(6.0 * d), _ru32(12.0 * d), _ru32(24.0 * d),
            _ru32(48.0 * d))


@_jit
def _e3m0_code(v, th):
    a = v & ABS
    e = (np.int32(a >= th[0]) + np.int32(a >= th[1]) + np.int32(a >= th[2]) + np.int32(a >= th[3])
         + np.int32(a >= th[4]) + np.int32(a >= th[5]) + np.int32(a >= th[6]))
    return e | ((v >> np.int32(28)) & np.int32(8))  # bit 3: the sign bit


@_jit
def _absmax_bits(xi, base, m):
    amax = np.int32(0)
    for j in range(m):
        amax = max(amax, xi[base + j] & ABS)
    return amax


@_jit
def e3m0_encode(xi, n, b0, b1, data, scales):
    """xi: the float32 input's bits (n elements); writes data[32 b:32 b + 32] and scales[b] for b in [b0, b1)."""
    if n > xi.shape[0] or b1 * 32 > data.shape[0] or b1 > scales.shape[0] or b1 > (n + 63) // 64 or b0 < 0:
        return 2
    return _e3m0_encode_blocks(xi, n, b0, b1, data, scales)


@_jit
def _e3m0_encode_blocks(xi, n, b0, b1, data, scales):
    """e3m0_encode's loop, sizes checked (in a function of its own: with the checks before it, the loop
    compiles to code twice as slow). A block's codes go to a local int32 array first: the loop with a
    narrowing store would not vectorize."""
    un = np.uint64(n)
    codes = np.zeros(64, np.int32)
    for b in range(np.uint64(b0), np.uint64(b1)):
        base = b * U64
        m = min(U64, un - base)
        amax = _absmax_bits(xi, base, m)
        if amax >= INF_BITS:
            return 1
        s = i2f(amax) / F32_64
        scales[b] = s
        th = _e3m0_thresholds(s)
        if m == U64:  # a constant trip count: the loop vectorizes
            for j in range(U64):
                codes[j] = _e3m0_code(xi[base + j], th)
        else:  # the tail block: padding encodes as code 0
            for j in range(U64):
                codes[j] = _e3m0_code(xi[base + j], th) if j < m else np.int32(0)
        for i in range(U32):
            data[b * U32 + i] = np.uint8(codes[U2 * i] | (codes[U2 * i + U1] << np.int32(4)))
    return 0


@_jit
def _e3m0_value(c):
    """Value of code c (int32, 0..15) in scales: 0 or +-2^(e-1) for exponent field e; code 8 is +0.0."""
    e = c & np.int32(7)
    bits = ((np.int32(126) + e) << np.int32(23)) | ((c & np.int32(8)) << np.int32(28))
    return i2f(np.int32(bits) if e != 0 else np.int32(0))


@_jit
def e3m0_decode(data, scales, out, n, b0, b1):
    """out[64 b + j] = value of code j of block b times scales[b]; out has n elements."""
    if b1 * 32 > data.shape[0] or b1 > scales.shape[0] or n > out.shape[0] or b1 > (n + 63) // 64 or b0 < 0:
        return 2  # arrays smaller than the range: the callers' size checks rule it out
    un = np.uint64(n)
    for b in range(np.uint64(b0), np.uint64(b1)):
        s = scales[b]
        base = b * U64
        m = min(U64, un - base)
        if m == U64:
            for i in range(U32):
                d = np.int32(data[b * U32 + i])
                out[base + U2 * i] = _e3m0_value(d & np.int32(15)) * s
                out[base + U2 * i + U1] = _e3m0_value(d >> np.int32(4)) * s
        else:
            for j in range(m):
                d = np.int32(data[b * U32 + j // U2])
                out[base + j] = _e3m0_value((d >> (np.int32(j & U1) * np.int32(4))) & np.int32(15)) * s
    return 0


@_jit
def _to_e4m3fn(f):
    """float32 (|f| <= 448) -> e4m3fn byte (as an int32), round to nearest even: c10's fp8e4m3fn_from_fp32_value
    in int32 (no NaN branch: |f| <= 448), both cases computed and one selected, so the loops vectorize."""
    v = f2i(f)
    u = np.int32(v & ABS)
    sub = np.int32(f2i(i2f(u) + F32_DENORM) - np.int32(141 << 23))  # the add rounds |f| to a multiple of 2^-9
    odd = np.int32((u >> np.int32(20)) & np.int32(1))
    normal = np.int32(np.int32(np.int32(u + np.int32(((7 - 127) << 23) + 0x7FFFF)) + odd) >> np.int32(20))
    r = sub if u < np.int32(121 << 23) else normal
    return np.int32(r | np.int32((v >> np.int32(24)) & np.int32(0x80)))


@_jit
def fp8_encode(xf, xi, n, b0, b1, data, scales):
    """Blocks of 64: s = absmax / 448 (one ulp down if 448 s overflows), codes of clamp(x / s, +-448)."""
    if n > xf.shape[0] or n > xi.shape[0] or b1 * 64 > data.shape[0] or b1 > scales.shape[0] \
            or b1 > (n + 63) // 64 or b0 < 0:
        return 2
    return _fp8_encode_blocks(xf, xi, n, b0, b1, data, scales)


@_jit
def _fp8_encode_blocks(xf, xi, n, b0, b1, data, scales):
    """fp8_encode's loop, sizes checked (apart, and codes staged in int32, as in :func:`_e3m0_encode_blocks`)."""
    un = np.uint64(n)
    codes = np.zeros(64, np.int32)
    for b in range(np.uint64(b0), np.uint64(b1)):
        base = b * U64
        m = min(U64, un - base)
        amax = _absmax_bits(xi, base, m)
        if amax >= INF_BITS:
            return 1
        s = i2f(amax) / F32_448
        if np.isinf(s * F32_448):  # absmax near FLT_MAX: one ulp down (s > 0)
            s = i2f(f2i(s) - np.int32(1))
        scales[b] = s
        d = s if s > 0 else F32_ONE
        if m == U64:  # a constant trip count: the loop vectorizes
            for j in range(U64):
                codes[j] = _to_e4m3fn(min(max(xf[base + j] / d, -F32_448), F32_448))
        else:
            for j in range(m):
                codes[j] = _to_e4m3fn(min(max(xf[base + j] / d, -F32_448), F32_448))
            for j in range(m, U64):
                codes[j] = 0
        for j in range(U64):
            data[base + j] = np.uint8(codes[j])
    return 0


@_jit
def _e4m3fn_value(c):
    """float32 value of e4m3fn byte c (int32); 0x80 is +0.0 (the NaN codes 0x7F, 0xFF are caught apart)."""
    e = np.int32((c >> np.int32(3)) & np.int32(15))
    m = np.int32(c & np.int32(7))
    normal = np.int32(np.int32(np.int32(e + np.int32(120)) << np.int32(23)) | np.int32(m << np.int32(20)))
    mag = normal if e != 0 else f2i(np.float32(m) * F32_2M9)  # subnormal: m * 2^-9, exact
    sign = np.int32(np.int32(c & np.int32(0x80)) << np.int32(24))
    return i2f(np.int32(mag | sign) if mag != 0 else np.int32(0))


@_jit
def fp8_decode(codes, scales, out, n, b0, b1):
    """out = value(code) * scale; returns 1 if any code of the blocks (padding included) is a NaN code."""
    if b1 * 64 > codes.shape[0] or b1 > scales.shape[0] or n > out.shape[0] or b1 > (n + 63) // 64 or b0 < 0:
        return 2  # arrays smaller than the range: the callers' size checks rule it out
    un = np.uint64(n)
    peak = np.uint8(0)
    for b in range(np.uint64(b0), np.uint64(b1)):
        s = scales[b]
        base = b * U64
        if base + U64 <= un:  # a whole block: one pass, a constant trip count
            for j in range(U64):
                c = codes[base + j]
                peak = max(peak, c & np.uint8(0x7F))
                out[base + j] = _e4m3fn_value(np.int32(c)) * s
        else:
            for j in range(U64):
                peak = max(peak, codes[base + j] & np.uint8(0x7F))
            for j in range(un - base):
                out[base + j] = _e4m3fn_value(np.int32(codes[base + j])) * s
    return np.int32(peak == 0x7F)


@_jit
def bf16_encode(xi, i0, i1, out):
    """float32 bits -> bfloat16 bits, round to nearest even; finite values that round to Inf saturate. Rounds the
    magnitude in int32 lanes (|x| + 0x7FFF + lsb does not overflow for a finite |x|; a NaN's result is dropped,
    the flag raised) and puts the sign back after."""
    if i1 > xi.shape[0] or i1 > out.shape[0] or i0 < 0:
        return 2
    peak = np.int32(0)
    for i in range(np.uint64(i0), np.uint64(i1)):
        v = xi[i]
        a = v & ABS
        peak = max(peak, a)
        r = np.int32(np.int32(a + np.int32(np.int32(np.int32(a >> np.int32(16)) & np.int32(1)) + np.int32(0x7FFF)))
                     >> np.int32(16))
        r = min(r, np.int32(0x7F7F))  # past the bf16 max: saturate
        out[i] = np.uint16(r | np.int32(np.int32(v >> np.int32(16)) & np.int32(0x8000)))
    return np.int32(peak >= INF_BITS)


@_jit
def bf16_decode(bits, out, i0, i1):
    """out (float32 bits as int32) = bits << 16; returns 1 if any value is Inf or NaN."""
    if i1 > bits.shape[0] or i1 > out.shape[0] or i0 < 0:
        return 2  # arrays smaller than the range: the callers' size checks rule it out
    peak = np.int32(0)
    for i in range(np.uint64(i0), np.uint64(i1)):
        v = np.int32(bits[i])
        peak = max(peak, v & np.int32(0x7FFF))
        out[i] = v << np.int32(16)
    return np.int32(peak >= 0x7F80)


# ------------------------------------------------------------------------------------------ top-k


@_jit
def _kth_largest(vals, c, k, lo, hi):
    """The k-th largest of vals[:c] (int32 >= 0), given that it lies in [lo, hi]: the largest t there with
    #(vals >= t) >= k, by bisection of the value (branch-free counts vectorize; a quickselect mispredicts)."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        cnt = 0
        for i in range(c):
            cnt += np.int64(vals[i] >= mid)
        if cnt >= k:
            lo = mid
        else:
            hi = mid - 1
    return np.int32(lo)


@_jit
def topk_encode(xi, n, k, b0, b1, entries, scales, amb):
    """Blocks of 4096: the k largest |x| (bits), in rising index order, as index << 4 | E3M0 code against
    absmax / 64. Where the k-th largest value ties with one left out, which of the tied ones torch.topk keeps
    is its own affair: the block is flagged in ``amb`` (and not written) for the caller's torch path."""
    if n > xi.shape[0] or b1 > scales.shape[0] or b1 > amb.shape[0] or b1 > (n + 4095) // 4096 or b0 < 0 \
            or entries.shape[0] < min(n, 4096 * b1) // 4096 * k + min(k, min(n, 4096 * b1) % 4096):
        return 2
    gmax = np.empty(256, np.int32)  # the largest |x| of each group of 16: only groups that reach the guess are read
    cand = np.empty(4096, np.uint64)
    work = np.empty(4096, np.int32)
    uk = np.uint64(k)
    for b in range(np.uint64(b0), np.uint64(b1)):
        base = b * U4096
        m = min(U4096, np.uint64(n) - base)
        ng = (m + U15) // U16
        amax = np.int32(0)
        for g in range(ng):
            gm = _absmax_bits(xi, base + U16 * g, min(U16, m - U16 * g))
            gmax[g] = gm
            amax = max(amax, gm)
        if amax >= INF_BITS:
            return 1
        amaxf = i2f(amax)
        s = amaxf / F32_64
        scales[b] = s
        th = _e3m0_thresholds(s)
        out0 = b * uk
        if m <= uk:  # a short tail block: all of it
            for j in range(m):
                entries[out0 + j] = np.uint16((np.int32(j) << np.int32(4)) | _e3m0_code(xi[base + j], th))
            continue
        # candidates: |x| >= the k-th largest group maximum, which k distinct elements reach, so at least k
        guess = np.int32(0) if ng < uk else _kth_largest(gmax, ng, k, np.int64(0), np.int64(amax))
        c = U1 - U1
        for g in range(ng):
            if gmax[g] >= guess:
                for j in range(U16 * g, min(U16 * g + U16, m)):
                    a = xi[base + j] & ABS
                    cand[c] = j
                    work[c] = a
                    c += np.uint64(a >= guess)
        t = _kth_largest(work, c, k, np.int64(guess), np.int64(amax))
        n_ge = 0
        for i in range(c):
            n_ge += np.int64(work[i] >= t)
        if n_ge != k:
            amb[b] = 1
            continue
        w = out0
        for i in range(c):
            j = cand[i]
            v = xi[base + j]
            if (v & ABS) >= t:
                entries[w] = np.uint16((np.int32(j) << np.int32(4)) | _e3m0_code(v, th))
                w += U1
    return 0


@_jit
def topk_check(entries, n, k):
    """0 if every block's indices rise strictly and stay inside the block; 1 if some do not rise, else 2."""
    count = entries.shape[0]
    for c in range(1, count):
        if c % k != 0 and (entries[c] >> 4) <= (entries[c - 1] >> 4):
            return 1
    n_blocks = (n + 4095) // 4096
    for c in range(count):
        b = c // k
        limit = n - 4096 * b if b == n_blocks - 1 else 4096
        if (entries[c] >> 4) >= limit:
            return 2
    return 0


@_jit
def topk_decode(entries, scales, out, n, k, b0, b1):
    """Zeros, then the value of each entry of blocks [b0, b1) (checked by topk_check; bounds checked again)."""
    if b1 > scales.shape[0] or n > out.shape[0] or b1 > (n + 4095) // 4096 or b0 < 0:
        return 2  # arrays smaller than the range: the callers' size checks rule it out
    count = np.uint64(entries.shape[0])
    uk = np.uint64(k)
    for b in range(np.uint64(b0), np.uint64(b1)):
        base = b * U4096
        m = min(U4096, np.uint64(n) - base)
        for j in range(m):
            out[base + j] = 0.0
        s = scales[b]
        for c in range(b * uk, min(b * uk + uk, count)):
            e = np.uint64(entries[c])
            j = e >> np.uint64(4)
            if j < m:
                out[base + j] = E3M0_VALUES[e & U15] * s
    return 0


# ------------------------------------------------------------------------------------------ outer step


@_jit
def nesterov(G, v, d, G_out, v_out, m, lr, i0, i1):
    """NesterovSGD.step_ from G, v into G_out, v_out, elements [i0, i1): v' = v*m + d; G' = G - (v'*m + d)*lr."""
    if i1 > G.shape[0] or i1 > v.shape[0] or i1 > d.shape[0] or i1 > G_out.shape[0] or i1 > v_out.shape[0] or i0 < 0:
        return 2
    for i in range(np.uint64(i0), np.uint64(i1)):
        vv = v[i] * m + d[i]
        v_out[i] = vv
        G_out[i] = G[i] - (vv * m + d[i]) * lr
    return 0


# The parameters' kernels take a fragment's parameters as one typed list of 1-D arrays, ``thetas``, param j being
# elements [offsets[j], offsets[j + 1]) of the fragment's flat vector, and work on the flat range [i0, i1): one call
# for the whole fragment (each call gives the GIL back once, and on a busy peer getting it back can take a
# scheduler's time slice).


@_jit
def _params_fit(thetas, offsets, i0, i1, n):
    """Whether the list, its offsets and the flat arrays (n elements) hold the range [i0, i1)."""
    if len(offsets) != len(thetas) + 1 or i0 < 0 or i1 > offsets[len(thetas)] or i1 > n:
        return False
    for j in range(len(thetas)):
        if thetas[j].shape[0] != offsets[j + 1] - offsets[j]:
            return False
    return True


@_jit
def eager_jump(thetas, offsets, G, v, d, jump, k_v, k_out, i0, i1):
    """The eager jump of the alpha = 0 merge over the parameters' elements [i0, i1) (written): the target
    t = (v*k_v + d)*k_out + G (NesterovSGD.effect, then + G), jump = t - theta, theta = t."""
    n = min(G.shape[0], v.shape[0], d.shape[0], jump.shape[0])
    if not _params_fit(thetas, offsets, i0, i1, n):
        return 2
    for j in range(len(thetas)):
        a, b, base = max(offsets[j], i0), min(offsets[j + 1], i1), np.uint64(offsets[j])
        theta = thetas[j]
        for i in range(np.uint64(a), np.uint64(max(a, b))):
            t = (v[i] * k_v + d[i]) * k_out + G[i]
            jump[i] = t - theta[i - base]
            theta[i - base] = t
    return 0


@_jit
def difference(thetas, offsets, S, out, i0, i1):
    """out = S - theta over the parameters' elements [i0, i1)."""
    if not _params_fit(thetas, offsets, i0, i1, min(S.shape[0], out.shape[0])):
        return 2
    for j in range(len(thetas)):
        a, b, base = max(offsets[j], i0), min(offsets[j + 1], i1), np.uint64(offsets[j])
        theta = thetas[j]
        for i in range(np.uint64(a), np.uint64(max(a, b))):
            out[i] = S[i] - theta[i - base]
    return 0


@_jit
def assign(thetas, offsets, src, i0, i1):
    """theta = src over the parameters' elements [i0, i1)."""
    if not _params_fit(thetas, offsets, i0, i1, src.shape[0]):
        return 2
    for j in range(len(thetas)):
        a, b, base = max(offsets[j], i0), min(offsets[j + 1], i1), np.uint64(offsets[j])
        theta = thetas[j]
        for i in range(np.uint64(a), np.uint64(max(a, b))):
            theta[i - base] = src[i]
    return 0


# The same kernels holding the GIL, for small fragments: a call that gives the GIL back waits to get it back while
# another thread of the process runs Python (up to its switch interval, or its time slice on a shared core), which
# costs more than the work of a small fragment.


@_jit_held
def eager_jump_held(thetas, offsets, G, v, d, jump, k_v, k_out, i0, i1):
    return eager_jump(thetas, offsets, G, v, d, jump, k_v, k_out, i0, i1)


@_jit_held
def difference_held(thetas, offsets, S, out, i0, i1):
    return difference(thetas, offsets, S, out, i0, i1)


@_jit_held
def assign_held(thetas, offsets, src, i0, i1):
    return assign(thetas, offsets, src, i0, i1)


@_jit_held
def nesterov_held(G, v, d, G_out, v_out, m, lr, i0, i1):
    return nesterov(G, v, d, G_out, v_out, m, lr, i0, i1)
