"""The llumlet's end of its engine's migration channel (llumnix/engine/engine_channel.py): commands, the
engine's migration events sorted by migration id for the coordinator waiting on them, and what the
engine's staging holds (its STAGING_HELD reports)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from llumnix.engine.engine_channel import (
    EngineChannelError,
    EngineCommandClient,
    MigrationEventSubscriber,
    control_address,
    events_address,
)
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGING_HELD,
    CancelExport,
    DropStaging,
    EngineCommand,
    ExportFinal,
    ExportStage,
    KVChannel,
    MigrationEvent,
    OpenChannel,
)

logger = logging.getLogger("llumlet.migration")

STAGING_REPORT_STALE_S = 10.0
"""An engine reports its staging every second; a report this old is from an engine that stopped (its
staging went with it), so it is no longer shown."""


class EngineCommandRefused(RuntimeError):
    """The engine refused a command or did not answer (the message says which)."""


class EngineLink:
    def __init__(self, snapshot_addr: str, command_timeout_s: float = 5.0) -> None:
        self._commands = EngineCommandClient(control_address(snapshot_addr), command_timeout_s)
        self._events = MigrationEventSubscriber(events_address(snapshot_addr))
        self._queues: dict[str, asyncio.Queue[MigrationEvent]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._staging: MigrationEvent | None = None
        self._staging_received = 0.0

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read(), name="migration-events")

    async def _read(self) -> None:
        async for event in self._events.events():
            if event.kind == MIGRATION_EVENT_KIND_STAGING_HELD:
                self._staging, self._staging_received = event, time.monotonic()
                continue
            queue = self._queues.get(event.migration_id)
            if queue is not None:
                queue.put_nowait(event)

    def staging_held(self, now: float | None = None) -> MigrationEvent | None:
        """The engine's newest STAGING_HELD report (`migrations`, `blocks`, `bytes`); None before the
        first and once reports stopped for `STAGING_REPORT_STALE_S`."""
        now = time.monotonic() if now is None else now
        if self._staging is None or now - self._staging_received > STAGING_REPORT_STALE_S:
            return None
        return self._staging

    def watch(self, migration_id: str) -> asyncio.Queue[MigrationEvent]:
        """Events of that migration from now on, until `unwatch`."""
        return self._queues.setdefault(migration_id, asyncio.Queue())

    def unwatch(self, migration_id: str) -> None:
        self._queues.pop(migration_id, None)

    async def command(self, command: EngineCommand) -> None:
        try:
            reply = await self._commands.send(command)
        except EngineChannelError as exc:
            raise EngineCommandRefused(str(exc)) from None
        if not reply.ok:
            raise EngineCommandRefused(reply.error or "refused")

    async def export_stage(self, migration_id: str, request_id: str, kv_address: str, transport: str,
                           channel: KVChannel, kv_key: bytes, final: bool) -> None:
        """`channel`: the pair channel the destination opened (empty for tcp); `kv_key`: the key the
        destination's receiver requires of this migration's frames."""
        fields = {"migration_id": migration_id, "request_id": request_id, "kv_address": kv_address,
                  "transport": transport, "channel": channel, "kv_key": kv_key}
        if final:
            await self.command(EngineCommand(export_final=ExportFinal(**fields)))
        else:
            await self.command(EngineCommand(export_stage=ExportStage(**fields)))

    async def open_channel(self, backend: str, migration_id: str) -> KVChannel:
        """As a destination: the rendezvous of a fresh pair channel (gloo, nccl) for the migration."""
        try:
            reply = await self._commands.send(
                EngineCommand(open_channel=OpenChannel(backend=backend, migration_id=migration_id)))
        except EngineChannelError as exc:
            raise EngineCommandRefused(str(exc)) from None
        if not reply.ok:
            raise EngineCommandRefused(reply.error or "refused")
        return reply.channel

    async def cancel_export(self, migration_id: str) -> None:
        """Best effort: a failed migration's cleanup must not fail."""
        with contextlib.suppress(EngineCommandRefused):
            await self.command(EngineCommand(cancel_export=CancelExport(migration_id=migration_id)))

    async def drop_staging(self, migration_id: str) -> None:
        with contextlib.suppress(EngineCommandRefused):
            await self.command(EngineCommand(drop_staging=DropStaging(migration_id=migration_id)))

    async def close(self) -> None:
        self._events.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._commands.close()
