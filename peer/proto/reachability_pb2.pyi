from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("maddrs",)
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, maddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reachable", "address", "error", "dialed", "observed_ip")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DIALED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_IP_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    address: str
    error: str
    dialed: bool
    observed_ip: str
    def __init__(self, reachable: _Optional[bool] = ..., address: _Optional[str] = ..., error: _Optional[str] = ..., dialed: _Optional[bool] = ..., observed_ip: _Optional[str] = ...) -> None: ...
