from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("fragment", "round", "max_bytes_per_second", "offset", "count")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    max_bytes_per_second: float
    offset: int
    count: int
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., max_bytes_per_second: _Optional[float] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("fragment", "round", "digest", "numel", "step", "offset", "g", "v", "error", "blocks")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    G_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    digest: str
    numel: int
    step: int
    offset: int
    g: bytes
    v: bytes
    error: str
    blocks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., digest: _Optional[str] = ..., numel: _Optional[int] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ..., g: _Optional[bytes] = ..., v: _Optional[bytes] = ..., error: _Optional[str] = ..., blocks: _Optional[_Iterable[bytes]] = ...) -> None: ...
