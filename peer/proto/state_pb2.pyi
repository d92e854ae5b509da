from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("fragment", "round", "max_bytes_per_second")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    max_bytes_per_second: float
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., max_bytes_per_second: _Optional[float] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("fragment", "round", "digest", "numel", "step", "offset", "g", "v", "error")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    G_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    digest: str
    numel: int
    step: int
    offset: int
    g: bytes
    v: bytes
    error: str
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., digest: _Optional[str] = ..., numel: _Optional[int] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ..., g: _Optional[bytes] = ..., v: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...
