from llumnix.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from llumnix.v1 import llumlet_pb2 as _llumlet_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationSelect(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_SELECT_UNSPECIFIED: _ClassVar[MigrationSelect]
    MIGRATION_SELECT_LAST_COME: _ClassVar[MigrationSelect]
    MIGRATION_SELECT_SHORTEST: _ClassVar[MigrationSelect]
    MIGRATION_SELECT_LONGEST: _ClassVar[MigrationSelect]

class MigrationOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_OUTCOME_UNSPECIFIED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_COMMITTED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_REFUSED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_NO_CANDIDATE: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_BUSY: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_ABORTED: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_FINISHED_ON_SOURCE: _ClassVar[MigrationOutcome]
    MIGRATION_OUTCOME_RESUMED_ON_SOURCE: _ClassVar[MigrationOutcome]
MIGRATION_SELECT_UNSPECIFIED: MigrationSelect
MIGRATION_SELECT_LAST_COME: MigrationSelect
MIGRATION_SELECT_SHORTEST: MigrationSelect
MIGRATION_SELECT_LONGEST: MigrationSelect
MIGRATION_OUTCOME_UNSPECIFIED: MigrationOutcome
MIGRATION_OUTCOME_COMMITTED: MigrationOutcome
MIGRATION_OUTCOME_REFUSED: MigrationOutcome
MIGRATION_OUTCOME_NO_CANDIDATE: MigrationOutcome
MIGRATION_OUTCOME_BUSY: MigrationOutcome
MIGRATION_OUTCOME_ABORTED: MigrationOutcome
MIGRATION_OUTCOME_FINISHED_ON_SOURCE: MigrationOutcome
MIGRATION_OUTCOME_RESUMED_ON_SOURCE: MigrationOutcome

class MigrateOutRequest(_message.Message):
    __slots__ = ("destination_instance_id", "destination_address", "request_id", "select")
    DESTINATION_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    destination_instance_id: str
    destination_address: str
    request_id: str
    select: MigrationSelect
    def __init__(self, destination_instance_id: _Optional[str] = ..., destination_address: _Optional[str] = ..., request_id: _Optional[str] = ..., select: _Optional[_Union[MigrationSelect, str]] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("outcome", "migration_id", "request_id", "reason", "stages", "bytes", "migrated_tokens", "downtime_ms", "duration_ms", "transport", "final_stage_ms", "final_stage_kv_ms", "final_stage_event_ms", "commit_ms", "destination_first_token_ms", "destination_admitted_ms", "destination_kv_load_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FINAL_STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    FINAL_STAGE_KV_MS_FIELD_NUMBER: _ClassVar[int]
    FINAL_STAGE_EVENT_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ADMITTED_MS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_KV_LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: MigrationOutcome
    migration_id: str
    request_id: str
    reason: str
    stages: int
    bytes: int
    migrated_tokens: int
    downtime_ms: float
    duration_ms: float
    transport: str
    final_stage_ms: float
    final_stage_kv_ms: float
    final_stage_event_ms: float
    commit_ms: float
    destination_first_token_ms: float
    destination_admitted_ms: float
    destination_kv_load_ms: float
    def __init__(self, outcome: _Optional[_Union[MigrationOutcome, str]] = ..., migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ..., stages: _Optional[int] = ..., bytes: _Optional[int] = ..., migrated_tokens: _Optional[int] = ..., downtime_ms: _Optional[float] = ..., duration_ms: _Optional[float] = ..., transport: _Optional[str] = ..., final_stage_ms: _Optional[float] = ..., final_stage_kv_ms: _Optional[float] = ..., final_stage_event_ms: _Optional[float] = ..., commit_ms: _Optional[float] = ..., destination_first_token_ms: _Optional[float] = ..., destination_admitted_ms: _Optional[float] = ..., destination_kv_load_ms: _Optional[float] = ...) -> None: ...

class ProposeMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "source_instance_id", "source_address", "request_id", "endpoint", "body_json", "priority", "prompt_tokens", "output_tokens", "blocks", "handshake_json", "lease_ms", "transport")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    source_instance_id: str
    source_address: str
    request_id: str
    endpoint: _llumlet_pb2.Endpoint
    body_json: str
    priority: _llumlet_pb2.Priority
    prompt_tokens: int
    output_tokens: int
    blocks: int
    handshake_json: str
    lease_ms: int
    transport: str
    def __init__(self, migration_id: _Optional[str] = ..., source_instance_id: _Optional[str] = ..., source_address: _Optional[str] = ..., request_id: _Optional[str] = ..., endpoint: _Optional[_Union[_llumlet_pb2.Endpoint, str]] = ..., body_json: _Optional[str] = ..., priority: _Optional[_Union[_llumlet_pb2.Priority, str]] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., handshake_json: _Optional[str] = ..., lease_ms: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class ProposeMigrationResponse(_message.Message):
    __slots__ = ("accepted", "reason", "kv_address", "transport", "lease_ms", "channel", "kv_key")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    KV_KEY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    kv_address: str
    transport: str
    lease_ms: int
    channel: _kv_transfer_pb2.KVChannel
    kv_key: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., kv_address: _Optional[str] = ..., transport: _Optional[str] = ..., lease_ms: _Optional[int] = ..., channel: _Optional[_Union[_kv_transfer_pb2.KVChannel, _Mapping]] = ..., kv_key: _Optional[bytes] = ...) -> None: ...

class RenewMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "stages", "staged_tokens")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    STAGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    stages: int
    staged_tokens: int
    def __init__(self, migration_id: _Optional[str] = ..., stages: _Optional[int] = ..., staged_tokens: _Optional[int] = ...) -> None: ...

class RenewMigrationResponse(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class CommitMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "prompt_token_ids", "generated_token_ids", "staged_tokens", "generated_text")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    staged_tokens: int
    generated_text: str
    def __init__(self, migration_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., staged_tokens: _Optional[int] = ..., generated_text: _Optional[str] = ...) -> None: ...

class CommitMigrationResponse(_message.Message):
    __slots__ = ("ok", "reason", "first_token_ms", "admitted_ms", "kv_load_ms")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_MS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    first_token_ms: float
    admitted_ms: float
    kv_load_ms: float
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., first_token_ms: _Optional[float] = ..., admitted_ms: _Optional[float] = ..., kv_load_ms: _Optional[float] = ...) -> None: ...

class AbortMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "reason")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    reason: str
    def __init__(self, migration_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortMigrationResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
