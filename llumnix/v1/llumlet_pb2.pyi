from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOAD_SOURCE_UNSPECIFIED: _ClassVar[LoadSource]
    LOAD_SOURCE_CONNECTOR: _ClassVar[LoadSource]
    LOAD_SOURCE_METRICS_FALLBACK: _ClassVar[LoadSource]

class Endpoint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENDPOINT_UNSPECIFIED: _ClassVar[Endpoint]
    ENDPOINT_COMPLETION: _ClassVar[Endpoint]
    ENDPOINT_CHAT: _ClassVar[Endpoint]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_HIGH: _ClassVar[Priority]

class HealthStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_STATUS_UNSPECIFIED: _ClassVar[HealthStatus]
    HEALTH_STATUS_SERVING: _ClassVar[HealthStatus]
    HEALTH_STATUS_DEGRADED: _ClassVar[HealthStatus]
    HEALTH_STATUS_NOT_SERVING: _ClassVar[HealthStatus]
LOAD_SOURCE_UNSPECIFIED: LoadSource
LOAD_SOURCE_CONNECTOR: LoadSource
LOAD_SOURCE_METRICS_FALLBACK: LoadSource
ENDPOINT_UNSPECIFIED: Endpoint
ENDPOINT_COMPLETION: Endpoint
ENDPOINT_CHAT: Endpoint
PRIORITY_NORMAL: Priority
PRIORITY_HIGH: Priority
HEALTH_STATUS_UNSPECIFIED: HealthStatus
HEALTH_STATUS_SERVING: HealthStatus
HEALTH_STATUS_DEGRADED: HealthStatus
HEALTH_STATUS_NOT_SERVING: HealthStatus

class RequestLoad(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "output_tokens", "blocks", "high_priority", "arrival_time", "migrating")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIGH_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    MIGRATING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    output_tokens: int
    blocks: int
    high_priority: bool
    arrival_time: float
    migrating: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., high_priority: _Optional[bool] = ..., arrival_time: _Optional[float] = ..., migrating: _Optional[bool] = ...) -> None: ...

class PrefixCacheChanges(_message.Message):
    __slots__ = ("full", "stored", "removed")
    FULL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    full: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, full: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("instance_id", "total_blocks", "free_blocks", "block_size", "running", "waiting", "draining", "preemptions", "migrating_out", "migrating_in", "reserved_blocks", "timestamp", "freeness", "virtual_usage", "snapshot_age_s", "source", "sequence", "prefix_cache")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATING_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATING_IN_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FREENESS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    total_blocks: int
    free_blocks: int
    block_size: int
    running: _containers.RepeatedCompositeFieldContainer[RequestLoad]
    waiting: _containers.RepeatedCompositeFieldContainer[RequestLoad]
    draining: bool
    preemptions: int
    migrating_out: int
    migrating_in: int
    reserved_blocks: int
    timestamp: float
    freeness: float
    virtual_usage: float
    snapshot_age_s: float
    source: LoadSource
    sequence: int
    prefix_cache: PrefixCacheChanges
    def __init__(self, instance_id: _Optional[str] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RequestLoad, _Mapping]]] = ..., waiting: _Optional[_Iterable[_Union[RequestLoad, _Mapping]]] = ..., draining: _Optional[bool] = ..., preemptions: _Optional[int] = ..., migrating_out: _Optional[int] = ..., migrating_in: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., timestamp: _Optional[float] = ..., freeness: _Optional[float] = ..., virtual_usage: _Optional[float] = ..., snapshot_age_s: _Optional[float] = ..., source: _Optional[_Union[LoadSource, str]] = ..., sequence: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheChanges, _Mapping]] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_ms", "max_interval_ms")
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    min_interval_ms: int
    max_interval_ms: int
    def __init__(self, min_interval_ms: _Optional[int] = ..., max_interval_ms: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "endpoint", "body_json", "priority", "attach")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    endpoint: Endpoint
    body_json: str
    priority: Priority
    attach: bool
    def __init__(self, request_id: _Optional[str] = ..., endpoint: _Optional[_Union[Endpoint, str]] = ..., body_json: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., attach: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "stop_reason_json", "prompt_token_ids", "model", "usage", "role", "logprobs_json", "extra_delta_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_DELTA_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stop_reason_json: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    usage: Usage
    role: str
    logprobs_json: str
    extra_delta_json: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_reason_json: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., role: _Optional[str] = ..., logprobs_json: _Optional[str] = ..., extra_delta_json: _Optional[str] = ...) -> None: ...

class Moved(_message.Message):
    __slots__ = ("instance_id", "address", "request_id", "migration_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    request_id: str
    migration_id: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., request_id: _Optional[str] = ..., migration_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "moved")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateChunk
    moved: Moved
    def __init__(self, chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., moved: _Optional[_Union[Moved, _Mapping]] = ...) -> None: ...

class ServeCommand(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("status", "body_json")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    status: int
    body_json: str
    def __init__(self, status: _Optional[int] = ..., body_json: _Optional[str] = ...) -> None: ...

class ServeEvent(_message.Message):
    __slots__ = ("request_id", "chunk", "moved", "failure", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    moved: Moved
    failure: RequestFailure
    finished: bool
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., moved: _Optional[_Union[Moved, _Mapping]] = ..., failure: _Optional[_Union[RequestFailure, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class ServeEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ServeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ServeEvent, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class SetDrainingRequest(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class SetDrainingResponse(_message.Message):
    __slots__ = ("draining", "in_flight")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    in_flight: int
    def __init__(self, draining: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "instance_id", "engine_healthy", "draining", "load_source", "snapshot_age_s", "in_flight", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: HealthStatus
    instance_id: str
    engine_healthy: bool
    draining: bool
    load_source: LoadSource
    snapshot_age_s: float
    in_flight: int
    message: str
    def __init__(self, status: _Optional[_Union[HealthStatus, str]] = ..., instance_id: _Optional[str] = ..., engine_healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., load_source: _Optional[_Union[LoadSource, str]] = ..., snapshot_age_s: _Optional[float] = ..., in_flight: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
