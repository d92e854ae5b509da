from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    STARTING: _ClassVar[PeerState]
    TRAINING: _ClassVar[PeerState]
    PAUSED: _ClassVar[PeerState]
    FINISHING: _ClassVar[PeerState]
    PAUSING: _ClassVar[PeerState]
PEER_STATE_UNSPECIFIED: PeerState
STARTING: PeerState
TRAINING: PeerState
PAUSED: PeerState
FINISHING: PeerState
PAUSING: PeerState

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("index", "round", "digest", "numel")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    index: int
    round: int
    digest: str
    numel: int
    def __init__(self, index: _Optional[int] = ..., round: _Optional[int] = ..., digest: _Optional[str] = ..., numel: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("duty_cycle", "threads", "active_hours", "upload_mbps", "download_mbps")
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_HOURS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    duty_cycle: int
    threads: int
    active_hours: str
    upload_mbps: float
    download_mbps: float
    def __init__(self, duty_cycle: _Optional[int] = ..., threads: _Optional[int] = ..., active_hours: _Optional[str] = ..., upload_mbps: _Optional[float] = ..., download_mbps: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("peer_id", "state", "detail", "step", "loss", "tokens_per_second", "live_peers", "paused_peers", "fragments", "next_sync", "bytes_up", "bytes_down", "rounds_by_status", "tau", "device", "host_peak_bytes", "device_peak_bytes", "excluded_peers", "limits", "run_hash", "uptime_seconds", "idle_seconds", "eval_loss", "eval_perplexity", "eval_round")
    class RoundsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEERS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_PEERS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SYNC_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_PEERS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    RUN_HASH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    state: PeerState
    detail: str
    step: int
    loss: float
    tokens_per_second: float
    live_peers: int
    paused_peers: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    next_sync: str
    bytes_up: int
    bytes_down: int
    rounds_by_status: _containers.ScalarMap[str, int]
    tau: int
    device: str
    host_peak_bytes: int
    device_peak_bytes: int
    excluded_peers: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    run_hash: str
    uptime_seconds: float
    idle_seconds: float
    eval_loss: float
    eval_perplexity: float
    eval_round: int
    def __init__(self, peer_id: _Optional[str] = ..., state: _Optional[_Union[PeerState, str]] = ..., detail: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., live_peers: _Optional[int] = ..., paused_peers: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., next_sync: _Optional[str] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., rounds_by_status: _Optional[_Mapping[str, int]] = ..., tau: _Optional[int] = ..., device: _Optional[str] = ..., host_peak_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ..., excluded_peers: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., run_hash: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., eval_loss: _Optional[float] = ..., eval_perplexity: _Optional[float] = ..., eval_round: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("state", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: PeerState
    message: str
    def __init__(self, state: _Optional[_Union[PeerState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class SetLimitsRequest(_message.Message):
    __slots__ = ("duty_cycle", "threads", "active_hours", "upload_mbps", "download_mbps")
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_HOURS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    duty_cycle: int
    threads: int
    active_hours: str
    upload_mbps: float
    download_mbps: float
    def __init__(self, duty_cycle: _Optional[int] = ..., threads: _Optional[int] = ..., active_hours: _Optional[str] = ..., upload_mbps: _Optional[float] = ..., download_mbps: _Optional[float] = ...) -> None: ...

class LimitsReply(_message.Message):
    __slots__ = ("limits",)
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    limits: Limits
    def __init__(self, limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("backlog",)
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    backlog: int
    def __init__(self, backlog: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
