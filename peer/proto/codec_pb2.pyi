from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EncodedTensor(_message.Message):
    __slots__ = ("codec", "codec_version", "numel", "data", "scales", "block_size", "shape", "scalar")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    codec: str
    codec_version: int
    numel: int
    data: bytes
    scales: bytes
    block_size: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    scalar: bool
    def __init__(self, codec: _Optional[str] = ..., codec_version: _Optional[int] = ..., numel: _Optional[int] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., block_size: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., scalar: _Optional[bool] = ...) -> None: ...
