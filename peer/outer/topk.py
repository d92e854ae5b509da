"""Top-k sparse codecs for home uplinks (byte layout in protos/codec.proto): ``topk32``, ``topk64``,
``topk128`` send, of every block of 4096 elements, the k of largest magnitude, each as one little-endian uint16:
its index in the block (12 bits) and its FP4 E3M0 code (4 bits, :mod:`peer.outer.e3m0`'s rounding against the
block scale ``absmax / 64``). ``topk32`` is 0.13 bits per element, 34 times fewer than ``e3m0``.

What a round does not send stays with the sender: these codecs need error feedback (``outer.error_feedback``, the
config says so), which carries the rest into the next rounds, as SparseLoCo and DeMo do. A reducer's average is
encoded again by the same codec (re-sparsified to k per block): the butterfly's messages keep one size both ways.

Decoding checks the sizes first, then that every block's indices rise strictly and stay inside the block, so
every position is written at most once: the same bytes give bitwise identical tensors.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from peer.outer import cpu_path
from peer.outer.e3m0 import e3m0_code_values, e3m0_reference_codes
from peer.outer.wire import (_FLT_MAX, _check_float, _check_scales, _le_f32, _le_f32_bytes, _nonfinite_error, _read,
                             CodecError, all_finite, check_out, into)
from peer.proto import codec_pb2

BLOCK = 4096  # elements per block: a 12-bit index
TOPK_KS = (32, 64, 128)  # the registered densities: 0.78%, 1.6%, 3.1%


def entries_for(numel: int, k: int) -> int:
    """How many (index, code) entries a piece of ``numel`` elements carries: k per whole block, and of the last,
    partial block as many as it has elements, up to k."""
    full, tail = divmod(numel, BLOCK)
    return full * k + min(k, tail)


class TopKCodec:
    """``k`` entries of largest magnitude per block of :data:`BLOCK`; see the module docstring."""

    version, block_size = 1, BLOCK
    draws_random = False

    def __init__(self, k: int, cpu_kernels: bool = True):
        if k not in TOPK_KS:
            raise ValueError(f"top-k codecs keep {TOPK_KS} entries per block of {BLOCK}, not {k}")
        self.k = k
        self.name = f"topk{k}"
        self.cpu_kernels = cpu_kernels  # False: the torch path on the CPU too (the tests' reference)

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        flat = _check_float(flat)
        n = flat.numel()
        fast = cpu_path.topk_encode(flat, self.k, entries_for(n, self.k), self._select) if self.cpu_kernels else None
        if fast is not None:
            data, scale_bytes = fast
        else:
            x = flat.detach().to(torch.float32)
            if not all_finite(x):
                raise _nonfinite_error()
            n_blocks = -(-n // BLOCK)
            if n % BLOCK:  # zero-padded to whole blocks
                blocks = torch.zeros(n_blocks * BLOCK, dtype=torch.float32, device=x.device)
                blocks[:n] = x
            else:
                blocks = x
            entries, scales = self._select(blocks.view(n_blocks, BLOCK), n - (n_blocks - 1) * BLOCK)
            entries = entries.reshape(-1)[:entries_for(n, self.k)]  # (the padding sorts last in the last block)
            data, scale_bytes = entries.cpu().numpy().astype("<u2").tobytes(), _le_f32_bytes(scales.cpu())
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=n, block_size=BLOCK,
                                       data=data, scales=scale_bytes)

    def _select(self, blocks: torch.Tensor, n_last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (index << 4 | code, int32, k per block) and scales of whole blocks, the last of which has
        n_last real elements (the rest is zero padding)."""
        magnitude = blocks.abs()
        if n_last < BLOCK:  # the padding is never chosen: every real element outranks it
            magnitude[-1, n_last:] = -1.0
        index = magnitude.topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        codes, scales = e3m0_reference_codes(blocks.gather(1, index))  # scale: the block's absmax / 64
        return (index.to(torch.int32) << 4) | codes.to(torch.int32), scales

    def decode_flat(self, msg: codec_pb2.EncodedTensor, device: Optional[torch.device] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, k = msg.numel, self.k
        dest = check_out(out, n)
        if dest is not None:
            device = None
        n_blocks = -(-n // BLOCK)
        count = entries_for(n, k)
        data, scale_bytes = _read(msg, self, block_size=BLOCK, data_len=2 * count, n_scales=n_blocks)
        scales = _le_f32(scale_bytes).clone()
        _check_scales(scales, _FLT_MAX / 64, self.name)
        if self.cpu_kernels and (device is None or torch.device(device).type == "cpu"):
            fast = cpu_path.topk_decode(data, scale_bytes, n, k, self.name, dest)
            if fast is not None:
                return fast
        entries = torch.from_numpy(np.frombuffer(data, dtype="<u2").astype(np.int64))
        index, codes = entries >> 4, entries & 15
        block = torch.arange(count) // k  # the block of each entry (the last block's entries come last)
        starts = torch.zeros(count, dtype=torch.bool)
        starts[::k] = True  # (an entry that opens a block need not exceed the one before it)
        if count and not bool(((index[1:] > index[:-1]) | starts[1:]).all()):
            raise CodecError(f"{self.name} piece has a block whose indices do not rise strictly")
        limit = torch.full((count,), BLOCK, dtype=torch.int64)
        if n % BLOCK:
            limit[block == n_blocks - 1] = n % BLOCK
        if count and not bool((index < limit).all()):
            raise CodecError(f"{self.name} piece has an index past its block's end")
        values = torch.zeros(n, dtype=torch.float32)
        values[block * BLOCK + index] = e3m0_code_values()[codes] * scales[block]
        if dest is not None:
            return into(values, dest)
        return values.to(device) if device is not None else values
