from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "engine_request_id", "prompt_tokens", "output_tokens", "computed_tokens", "blocks", "high_priority", "arrival_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIGH_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    engine_request_id: str
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    blocks: int
    high_priority: bool
    arrival_time: float
    def __init__(self, request_id: _Optional[str] = ..., engine_request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., high_priority: _Optional[bool] = ..., arrival_time: _Optional[float] = ...) -> None: ...

class PrefixCacheUpdate(_message.Message):
    __slots__ = ("since", "until", "full", "stored", "removed")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    since: int
    until: int
    full: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, since: _Optional[int] = ..., until: _Optional[int] = ..., full: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineSnapshot(_message.Message):
    __slots__ = ("schema_version", "engine_id", "step", "timestamp", "total_blocks", "free_blocks", "block_size", "running", "waiting", "preemptions_total", "prefix_cache")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    engine_id: str
    step: int
    timestamp: float
    total_blocks: int
    free_blocks: int
    block_size: int
    running: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    waiting: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    preemptions_total: int
    prefix_cache: PrefixCacheUpdate
    def __init__(self, schema_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., step: _Optional[int] = ..., timestamp: _Optional[float] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ..., waiting: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ..., preemptions_total: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheUpdate, _Mapping]] = ...) -> None: ...
