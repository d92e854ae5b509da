"""Wire codecs for outer gradients: tensor <-> ``EncodedTensor`` protobuf (protos/codec.proto).

``encode(tensor, codec)`` returns the message; ``decode(message)`` returns an fp32 tensor of the
original shape. Decoding validates everything it reads (codec, version, sizes, finiteness), because
messages come from untrusted peers. Codecs register in :data:`CODECS`; the codec name and version
are part of the matchmaking key so peers with different codecs never share a group.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

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

    def decode_flat(self, msg: codec_pb2.EncodedTensor) -> torch.Tensor: ...


class Fp32Codec:
    """No compression: little-endian IEEE-754 binary32, 4 bytes per element."""

    name, version, block_size = "fp32", 1, 1

    def encode_flat(self, flat: torch.Tensor) -> codec_pb2.EncodedTensor:
        data = flat.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
        return codec_pb2.EncodedTensor(codec=self.name, codec_version=self.version, numel=flat.numel(), data=data)

    def decode_flat(self, msg: codec_pb2.EncodedTensor) -> torch.Tensor:
        if len(msg.data) != 4 * msg.numel:
            raise CodecError(f"fp32 piece has {len(msg.data)} bytes for {msg.numel} elements (expected {4 * msg.numel})")
        return torch.from_numpy(np.frombuffer(msg.data, dtype="<f4").astype(np.float32))


CODECS: dict[str, Codec] = {"fp32": Fp32Codec()}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(CODECS)}") from None


def codec_key(name: str) -> str:
    """Codec name and version, as used in matchmaking keys (e.g. ``fp32v1``)."""
    codec = get_codec(name)
    return f"{codec.name}v{codec.version}"


def encode(tensor: torch.Tensor, codec: str = "fp32") -> codec_pb2.EncodedTensor:
    """Encodes a whole tensor (any shape, floating dtype); non-finite values raise ``ValueError``."""
    if not tensor.is_floating_point():
        raise ValueError(f"encode: expected a floating-point tensor, got {tensor.dtype}")
    flat = tensor.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("encode: tensor has non-finite values (NaN/Inf are never put on the wire)")
    msg = get_codec(codec).encode_flat(flat)
    msg.shape.extend(tensor.shape)
    return msg


def decode(msg: codec_pb2.EncodedTensor, *, max_numel: int = 1 << 31) -> torch.Tensor:
    """Decodes a message into an fp32 CPU tensor of its shape; raises :class:`CodecError` if invalid."""
    codec = CODECS.get(msg.codec)
    if codec is None:
        raise CodecError(f"unknown codec {msg.codec!r}")
    if msg.codec_version != codec.version:
        raise CodecError(f"{msg.codec} version {msg.codec_version} is not supported (have {codec.version})")
    if msg.numel > max_numel:
        raise CodecError(f"piece of {msg.numel} elements exceeds the bound {max_numel}")
    shape: Sequence[int] = tuple(msg.shape) or (msg.numel,)
    if math.prod(shape) != msg.numel:
        raise CodecError(f"shape {tuple(shape)} does not match numel {msg.numel}")
    flat = codec.decode_flat(msg)
    if flat.numel() != msg.numel:
        raise CodecError(f"decoded {flat.numel()} elements, header says {msg.numel}")
    if not bool(torch.isfinite(flat).all()):
        raise CodecError("decoded piece has non-finite values")
    return flat.reshape(shape)
