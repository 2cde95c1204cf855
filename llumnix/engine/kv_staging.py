"""Destination-side staging of live migration: the KV stages a receiver got, per migration, until the
migrated-in request is loaded, dropped, or its lease runs out. What it holds is reported to the
engine's llumlet as `STAGING_HELD` migration events (on every change, and every
`STAGING_REPORT_INTERVAL_S` by the engine's reaper), which the llumlet exports on its /metrics."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from llumnix.engine.kv_transport import KV_FRAME_SCHEMA_VERSION
from llumnix.v1.kv_transfer_pb2 import MIGRATION_EVENT_KIND_STAGING_HELD, KVStageHeader, MigrationEvent

STAGING_REPORT_INTERVAL_S = 1.0
"""How often an engine reports its staging (and checks its lease) with nothing changing."""


@dataclasses.dataclass
class _Migration:
    blocks: dict[int, Any] = dataclasses.field(default_factory=dict)  # logical index -> block bytes
    num_tokens: int = 0
    stages: int = 0
    touched_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class StagedKV:
    """The staged blocks of one migration, taken out of the store for loading."""

    migration_id: str
    num_tokens: int
    block_data: dict[int, Any]

    def parts(self, first: int, last: int) -> list[Any]:
        """Blocks [first, last), one bytes-like (or flat uint8 tensor) per block, as staged: what
        `KVBlockCopier.copy_in_parts` takes without joining them first. KeyError names a missing block."""
        missing = [index for index in range(first, last) if index not in self.block_data]
        if missing:
            raise KeyError(f"migration {self.migration_id}: blocks {missing} were never staged")
        return [self.block_data[index] for index in range(first, last)]


@dataclasses.dataclass(frozen=True, slots=True)
class StagingHeld:
    """What a staging store holds, over every migration."""

    migrations: int
    blocks: int
    bytes: int

    def event(self) -> MigrationEvent:
        return MigrationEvent(kind=MIGRATION_EVENT_KIND_STAGING_HELD, migrations=self.migrations,
                              blocks=self.blocks, bytes=self.bytes, timestamp=time.time())


class StagingStore:
    """Destination-side staging, per migration id: logical block index -> bytes of that block (later
    stages overwrite the re-sent tail block), tokens staged. A migration untouched for `lease_s` is
    dropped by `expire`, so no staging outlives a failed migration, even one whose llumlet died.
    With `publish`, every change is reported as a `STAGING_HELD` event (`report`)."""

    def __init__(self, bytes_per_block: int, dtype: str, lease_s: float = 60.0,
                 publish: Callable[[MigrationEvent], None] | None = None) -> None:
        self.bytes_per_block = bytes_per_block
        self.dtype = dtype
        self.lease_s = lease_s
        self._publish = publish
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._migrations: dict[str, _Migration] = {}

    def check_layout(self, header: KVStageHeader) -> None:
        """ValueError unless the frame's schema, layout and size match this engine's KV layout."""
        if header.schema_version != KV_FRAME_SCHEMA_VERSION:
            raise ValueError(f"KV frame schema {header.schema_version} is not {KV_FRAME_SCHEMA_VERSION}")
        if header.bytes_per_block != self.bytes_per_block or header.dtype != self.dtype:
            raise ValueError(
                f"KV layout mismatch: frame has {header.bytes_per_block} bytes/block {header.dtype}, "
                f"this engine {self.bytes_per_block} bytes/block {self.dtype}"
            )
        if header.payload_bytes != header.num_blocks * self.bytes_per_block:
            raise ValueError(
                f"frame carries {header.payload_bytes} bytes for {header.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes"
            )

    def put(self, header: KVStageHeader, payload: Any, now: float | None = None) -> int:
        """Stores a stage's blocks (a bytes-like payload, or a flat uint8 tensor); returns tokens staged."""
        self.check_layout(header)
        size = self.bytes_per_block
        is_bytes = isinstance(payload, bytes | bytearray | memoryview)
        data = memoryview(payload).cast("B") if is_bytes else payload
        if len(data) != header.payload_bytes:
            raise ValueError(f"payload has {len(data)} bytes, the header says {header.payload_bytes}")
        with self._lock:
            entry = self._migrations.setdefault(header.migration_id, _Migration())
            for offset in range(header.num_blocks):
                entry.blocks[header.first_block + offset] = data[offset * size:(offset + 1) * size]
            entry.num_tokens = max(entry.num_tokens, header.num_tokens)
            entry.stages += 1
            entry.touched_at = time.monotonic() if now is None else now
            tokens = entry.num_tokens
        self.report()
        return tokens

    def staged_tokens(self, migration_id: str) -> int:
        with self._lock:
            entry = self._migrations.get(migration_id)
            return entry.num_tokens if entry else 0

    def take(self, migration_id: str) -> StagedKV | None:
        """Removes and returns a migration's staging (None when absent or expired)."""
        with self._lock:
            entry = self._migrations.pop(migration_id, None)
        if entry is None:
            return None
        self.report()
        return StagedKV(migration_id, entry.num_tokens, entry.blocks)

    def drop(self, migration_id: str) -> bool:
        with self._lock:
            dropped = self._migrations.pop(migration_id, None) is not None
        if dropped:
            self.report()
        return dropped

    def expire(self, now: float | None = None) -> list[str]:
        """Drops migrations untouched for lease_s; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                key for key, entry in self._migrations.items() if now - entry.touched_at >= self.lease_s
            ]
            for key in expired:
                del self._migrations[key]
        if expired:
            self.report()
        return expired

    def held(self) -> StagingHeld:
        with self._lock:
            blocks = sum(len(entry.blocks) for entry in self._migrations.values())
            return StagingHeld(len(self._migrations), blocks, blocks * self.bytes_per_block)

    def report(self) -> None:
        """Publishes what the store holds now. Reads and publications are serialized, so of reports
        racing from several threads the last one published is never older than the store."""
        if self._publish is None:
            return
        with self._report_lock:
            self._publish(self.held().event())

    @property
    def bytes_held(self) -> int:
        return self.held().bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._migrations)

