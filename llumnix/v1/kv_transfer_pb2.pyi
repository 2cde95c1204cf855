from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_EVENT_KIND_UNSPECIFIED: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_STAGE_SENT: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_STAGE_FAILED: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_STAGE_RECEIVED: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_LOADED: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_LOAD_FAILED: _ClassVar[MigrationEventKind]
    MIGRATION_EVENT_KIND_STAGING_HELD: _ClassVar[MigrationEventKind]
MIGRATION_EVENT_KIND_UNSPECIFIED: MigrationEventKind
MIGRATION_EVENT_KIND_STAGE_SENT: MigrationEventKind
MIGRATION_EVENT_KIND_STAGE_FAILED: MigrationEventKind
MIGRATION_EVENT_KIND_STAGE_RECEIVED: MigrationEventKind
MIGRATION_EVENT_KIND_LOADED: MigrationEventKind
MIGRATION_EVENT_KIND_LOAD_FAILED: MigrationEventKind
MIGRATION_EVENT_KIND_STAGING_HELD: MigrationEventKind

class ExportStage(_message.Message):
    __slots__ = ("migration_id", "request_id", "kv_address", "transport", "channel", "kv_key")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    KV_KEY_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    kv_address: str
    transport: str
    channel: KVChannel
    kv_key: bytes
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., transport: _Optional[str] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ..., kv_key: _Optional[bytes] = ...) -> None: ...

class ExportFinal(_message.Message):
    __slots__ = ("migration_id", "request_id", "kv_address", "transport", "channel", "kv_key")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    KV_KEY_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    kv_address: str
    transport: str
    channel: KVChannel
    kv_key: bytes
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., transport: _Optional[str] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ..., kv_key: _Optional[bytes] = ...) -> None: ...

class CancelExport(_message.Message):
    __slots__ = ("migration_id",)
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    def __init__(self, migration_id: _Optional[str] = ...) -> None: ...

class DropStaging(_message.Message):
    __slots__ = ("migration_id",)
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    def __init__(self, migration_id: _Optional[str] = ...) -> None: ...

class OpenChannel(_message.Message):
    __slots__ = ("backend", "migration_id")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    backend: str
    migration_id: str
    def __init__(self, backend: _Optional[str] = ..., migration_id: _Optional[str] = ...) -> None: ...

class KVChannel(_message.Message):
    __slots__ = ("backend", "channel_id", "nccl_unique_id", "store_address")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    channel_id: str
    nccl_unique_id: bytes
    store_address: str
    def __init__(self, backend: _Optional[str] = ..., channel_id: _Optional[str] = ..., nccl_unique_id: _Optional[bytes] = ..., store_address: _Optional[str] = ...) -> None: ...

class EngineCommand(_message.Message):
    __slots__ = ("schema_version", "export_stage", "export_final", "cancel_export", "drop_staging", "open_channel")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORT_STAGE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FINAL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_EXPORT_FIELD_NUMBER: _ClassVar[int]
    DROP_STAGING_FIELD_NUMBER: _ClassVar[int]
    OPEN_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    export_stage: ExportStage
    export_final: ExportFinal
    cancel_export: CancelExport
    drop_staging: DropStaging
    open_channel: OpenChannel
    def __init__(self, schema_version: _Optional[int] = ..., export_stage: _Optional[_Union[ExportStage, _Mapping]] = ..., export_final: _Optional[_Union[ExportFinal, _Mapping]] = ..., cancel_export: _Optional[_Union[CancelExport, _Mapping]] = ..., drop_staging: _Optional[_Union[DropStaging, _Mapping]] = ..., open_channel: _Optional[_Union[OpenChannel, _Mapping]] = ...) -> None: ...

class EngineCommandReply(_message.Message):
    __slots__ = ("ok", "error", "channel")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    channel: KVChannel
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ...) -> None: ...

class MigrationEvent(_message.Message):
    __slots__ = ("kind", "migration_id", "request_id", "stage", "final", "num_tokens", "blocks", "bytes", "copy_ms", "send_ms", "error", "timestamp", "migrations")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COPY_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    kind: MigrationEventKind
    migration_id: str
    request_id: str
    stage: int
    final: bool
    num_tokens: int
    blocks: int
    bytes: int
    copy_ms: float
    send_ms: float
    error: str
    timestamp: float
    migrations: int
    def __init__(self, kind: _Optional[_Union[MigrationEventKind, str]] = ..., migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., stage: _Optional[int] = ..., final: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., copy_ms: _Optional[float] = ..., send_ms: _Optional[float] = ..., error: _Optional[str] = ..., timestamp: _Optional[float] = ..., migrations: _Optional[int] = ...) -> None: ...

class KVStageHeader(_message.Message):
    __slots__ = ("schema_version", "migration_id", "stage", "final", "first_block", "num_blocks", "num_tokens", "payload_bytes", "bytes_per_block", "dtype", "channel", "kv_key")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    KV_KEY_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    migration_id: str
    stage: int
    final: bool
    first_block: int
    num_blocks: int
    num_tokens: int
    payload_bytes: int
    bytes_per_block: int
    dtype: str
    channel: KVChannel
    kv_key: bytes
    def __init__(self, schema_version: _Optional[int] = ..., migration_id: _Optional[str] = ..., stage: _Optional[int] = ..., final: _Optional[bool] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., dtype: _Optional[str] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ..., kv_key: _Optional[bytes] = ...) -> None: ...

class KVStageAck(_message.Message):
    __slots__ = ("migration_id", "stage", "ok", "error")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    stage: int
    ok: bool
    error: str
    def __init__(self, migration_id: _Optional[str] = ..., stage: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
