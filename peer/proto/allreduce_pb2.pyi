from . import codec_pb2 as _codec_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberInfo(_message.Message):
    __slots__ = ("protocol_version", "weight", "inner_step", "client_mode", "numel", "download_bytes_per_second", "slots", "upload_bytes_per_second", "base", "base_round", "expected", "members", "span_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    BASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SPAN_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    weight: float
    inner_step: int
    client_mode: bool
    numel: int
    download_bytes_per_second: float
    slots: int
    upload_bytes_per_second: float
    base: str
    base_round: int
    expected: int
    members: int
    span_key: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., weight: _Optional[float] = ..., inner_step: _Optional[int] = ..., client_mode: _Optional[bool] = ..., numel: _Optional[int] = ..., download_bytes_per_second: _Optional[float] = ..., slots: _Optional[int] = ..., upload_bytes_per_second: _Optional[float] = ..., base: _Optional[str] = ..., base_round: _Optional[int] = ..., expected: _Optional[int] = ..., members: _Optional[int] = ..., span_key: _Optional[bytes] = ...) -> None: ...

class SpanSeen(_message.Message):
    __slots__ = ("digest", "signature")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    signature: bytes
    def __init__(self, digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class MemberClaim(_message.Message):
    __slots__ = ("member", "key", "signature")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    member: int
    key: bytes
    signature: bytes
    def __init__(self, member: _Optional[int] = ..., key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("group_id", "span_index", "weight", "offset", "piece", "acknowledged", "claim")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    span_index: int
    weight: float
    offset: int
    piece: _codec_pb2.EncodedTensor
    acknowledged: int
    claim: MemberClaim
    def __init__(self, group_id: _Optional[bytes] = ..., span_index: _Optional[int] = ..., weight: _Optional[float] = ..., offset: _Optional[int] = ..., piece: _Optional[_Union[_codec_pb2.EncodedTensor, _Mapping]] = ..., acknowledged: _Optional[int] = ..., claim: _Optional[_Union[MemberClaim, _Mapping]] = ...) -> None: ...

class ReduceResponse(_message.Message):
    __slots__ = ("status", "error", "contributors", "total_weight", "offset", "piece", "acknowledged", "part_seconds", "part_bytes", "signature", "seen", "claims")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[ReduceResponse.Status]
        REJECTED: _ClassVar[ReduceResponse.Status]
        FAILED: _ClassVar[ReduceResponse.Status]
    OK: ReduceResponse.Status
    REJECTED: ReduceResponse.Status
    FAILED: ReduceResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    PART_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    status: ReduceResponse.Status
    error: str
    contributors: _containers.RepeatedScalarFieldContainer[int]
    total_weight: float
    offset: int
    piece: _codec_pb2.EncodedTensor
    acknowledged: int
    part_seconds: float
    part_bytes: int
    signature: bytes
    seen: _containers.RepeatedCompositeFieldContainer[SpanSeen]
    claims: _containers.RepeatedCompositeFieldContainer[MemberClaim]
    def __init__(self, status: _Optional[_Union[ReduceResponse.Status, str]] = ..., error: _Optional[str] = ..., contributors: _Optional[_Iterable[int]] = ..., total_weight: _Optional[float] = ..., offset: _Optional[int] = ..., piece: _Optional[_Union[_codec_pb2.EncodedTensor, _Mapping]] = ..., acknowledged: _Optional[int] = ..., part_seconds: _Optional[float] = ..., part_bytes: _Optional[int] = ..., signature: _Optional[bytes] = ..., seen: _Optional[_Iterable[_Union[SpanSeen, _Mapping]]] = ..., claims: _Optional[_Iterable[_Union[MemberClaim, _Mapping]]] = ...) -> None: ...
