"""The sim engine's side of live migration, on the same channels as the vLLM connector: it answers the
llumlet's commands (llumnix/engine/engine_channel.py), sends KV stages of small fake payloads to the peer
engine's receiver (llumnix/engine/kv_transport.py), publishes migration events, and starts a migrated-in
request with its staged tokens already computed. Its handshake record names the model and layout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llumnix.engine.engine_channel import (
    EngineCommandServer,
    MigrationEventPublisher,
    control_address,
    events_address,
)
from llumnix.engine.handshake import (
    HANDSHAKE_SCHEMA_VERSION,
    KV_SECRET_FIELD,
    default_handshake_path,
    write_handshake,
)
from llumnix.engine.kv_staging import STAGING_REPORT_INTERVAL_S, StagingStore
from llumnix.engine.kv_transport import KV_FRAME_SCHEMA_VERSION, KVSender, KVTransportError
from llumnix.engine.kv_transport_factory import make_receiver, make_sender
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_LOAD_FAILED,
    MIGRATION_EVENT_KIND_LOADED,
    MIGRATION_EVENT_KIND_STAGE_FAILED,
    MIGRATION_EVENT_KIND_STAGE_RECEIVED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    EngineCommand,
    EngineCommandReply,
    KVStageHeader,
    MigrationEvent,
)

if TYPE_CHECKING:
    from llumnix.sim_engine.engine import Generation, SimEngine

logger = logging.getLogger("llumnix.sim_engine")

SIM_KV_DTYPE = "sim"
DEFAULT_KV_BYTES_PER_BLOCK = 4096
STAGING_LEASE_S = 60.0
"""A migration's staging untouched this long is dropped (the connector's `staging_lease_s` default)."""
_COMMAND_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Export:
    migration_id: str
    request_id: str
    kv_address: str
    transport: str
    kv_key: bytes
    """The destination's key for this migration, on every frame."""
    stage_pending: bool = False
    final: bool = False
    stages: int = 0
    sent_full_blocks: int = 0
    task: asyncio.Task[None] | None = None


def _computed_tokens(generation: Generation) -> int:
    """Tokens whose KV exists: everything but the newest sampled token (computed by the next step)."""
    return max(0, generation.sim.prompt_tokens + generation.sim.generated - 1)


class SimMigrationAgent:
    def __init__(self, engine: SimEngine, snapshot_addr: str, host: str, model: str,
                 kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK) -> None:
        self.engine = engine
        self.snapshot_addr = snapshot_addr
        self.model = model
        self.bytes_per_block = kv_bytes_per_block
        self.events = MigrationEventPublisher(events_address(snapshot_addr))
        self.staging = StagingStore(kv_bytes_per_block, SIM_KV_DTYPE, STAGING_LEASE_S,
                                    publish=self.events.publish)
        self.receiver = make_receiver(host=host, staging=self.staging, on_stage=self._received)
        self._control_addr = control_address(snapshot_addr)
        self._commands: EngineCommandServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._exports: dict[str, _Export] = {}
        self._senders: dict[str, KVSender] = {}
        self._final_sends: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.receiver.start()
        self._reaper = asyncio.create_task(self._reap(), name="sim-staging-lease")
        self._commands = EngineCommandServer(self._control_addr, self._handle)
        path = default_handshake_path(self.snapshot_addr)
        if path is not None:
            write_handshake(path, self.handshake())

    def handshake(self) -> dict[str, object]:
        instance = self.engine.instance
        return {
            "schema_version": HANDSHAKE_SCHEMA_VERSION,
            "engine_id": self.engine.engine_id,
            "model": self.model,
            "kv_dtype": SIM_KV_DTYPE,
            "block_size": instance.block_size,
            "num_blocks": instance.total_blocks,
            "kv_layout": {"bytes_per_block": self.bytes_per_block, "memory_layout": "sim"},
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "pid": os.getpid(),
            "kv_address": self.receiver.address,
            "kv_channels": ["tcp"],
            KV_SECRET_FIELD: self.receiver.kv_secret,
        }

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._commands is not None:
            self._commands.close()
        self.receiver.close()
        self.events.close()
        for sender in self._senders.values():
            sender.close()

    # ----- commands (answered on the channel's thread, executed on the engine's loop)

    def _handle(self, command: EngineCommand) -> EngineCommandReply:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._execute(command), self._loop).result(_COMMAND_TIMEOUT_S)

    async def _execute(self, command: EngineCommand) -> EngineCommandReply:
        kind = command.WhichOneof("command")
        if kind in ("export_stage", "export_final"):
            spec = getattr(command, kind)
            if self._generation(spec.request_id) is None:
                return EngineCommandReply(ok=False, error=f"no running request {spec.request_id!r}")
            export = self._exports.setdefault(spec.migration_id, _Export(
                spec.migration_id, spec.request_id, spec.kv_address, spec.transport, spec.kv_key))
            if kind == "export_final":
                export.final = True
            else:
                export.stage_pending = True
            return EngineCommandReply(ok=True)
        if kind == "cancel_export":
            self._exports.pop(command.cancel_export.migration_id, None)
            return EngineCommandReply(ok=True)
        if kind == "drop_staging":
            self.staging.drop(command.drop_staging.migration_id)
            return EngineCommandReply(ok=True)
        return EngineCommandReply(ok=False, error=f"unknown engine command {kind!r}")

    def _generation(self, request_id: str) -> Generation | None:
        return next((g for g in self.engine.generations if g.tracking_id == request_id), None)

    # ----- source: stages

    def after_step(self) -> None:
        """Sends the stages asked for since the previous step (the connector does it at step end)."""
        for export in list(self._exports.values()):
            if not export.stage_pending or (export.task is not None and not export.task.done()):
                continue
            generation = self._generation(export.request_id)
            if generation is None:
                continue
            export.stage_pending = False
            export.task = asyncio.create_task(self._send(export, _computed_tokens(generation), final=False))

    def on_release(self, generation: Generation) -> None:
        """A request finished or was aborted: a pending final stage is sent now (its blocks held until
        it is), any other export of it fails."""
        for export in [e for e in self._exports.values() if e.request_id == generation.tracking_id]:
            del self._exports[export.migration_id]
            if export.final:
                task = asyncio.create_task(self._send_final(export, _computed_tokens(generation)))
                self._final_sends.add(task)
                task.add_done_callback(self._final_sends.discard)
            else:
                self._publish(MIGRATION_EVENT_KIND_STAGE_FAILED, export, error="the request finished")

    async def _send_final(self, export: _Export, tokens: int) -> None:
        instance = self.engine.instance
        held = -(-tokens // instance.block_size)
        delayed_free = instance.reserve(held)  # vLLM's delayed free: the blocks stay until sent
        try:
            if export.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await export.task
            await self._send(export, tokens, final=True)
        finally:
            if delayed_free:
                instance.unreserve(held)

    async def _send(self, export: _Export, tokens: int, final: bool) -> None:
        block_size = self.engine.instance.block_size
        first = export.sent_full_blocks
        count = max(0, -(-tokens // block_size) - first)
        header = KVStageHeader(
            schema_version=KV_FRAME_SCHEMA_VERSION, migration_id=export.migration_id, stage=export.stages + 1,
            final=final, first_block=first, num_blocks=count, num_tokens=tokens,
            payload_bytes=count * self.bytes_per_block, bytes_per_block=self.bytes_per_block,
            dtype=SIM_KV_DTYPE, kv_key=export.kv_key)
        started = time.monotonic()
        try:
            sender = self._sender(export)
            await asyncio.to_thread(sender.send, header, bytes(header.payload_bytes))
        except (KVTransportError, ValueError) as exc:
            self._publish(MIGRATION_EVENT_KIND_STAGE_FAILED, export, final=final, error=str(exc))
            self._exports.pop(export.migration_id, None)
            return
        export.stages += 1
        export.sent_full_blocks = tokens // block_size
        self._publish(MIGRATION_EVENT_KIND_STAGE_SENT, export, final=final, num_tokens=tokens, blocks=count,
                      bytes=header.payload_bytes, send_ms=(time.monotonic() - started) * 1e3)

    def _sender(self, export: _Export) -> KVSender:
        sender = self._senders.get(export.kv_address)
        if sender is None:
            sender = self._senders[export.kv_address] = make_sender(export.transport, export.kv_address)
        return sender

    def _publish(self, kind: int, export: _Export, **fields: object) -> None:
        self.events.publish(MigrationEvent(kind=kind, migration_id=export.migration_id,
                                           request_id=export.request_id, stage=export.stages,
                                           timestamp=time.time(), **fields))

    # ----- destination: staging and loading

    async def _reap(self) -> None:
        """As the connector's reaper: drops staging whose lease ran out (a migration whose llumlet died
        before DropStaging) and reports what staging holds, every `STAGING_REPORT_INTERVAL_S`."""
        while True:
            await asyncio.sleep(STAGING_REPORT_INTERVAL_S)
            for migration_id in self.staging.expire():
                logger.info("migration %s: staging lease expired, dropped", migration_id)
            self.staging.report()

    def _received(self, header: KVStageHeader) -> None:
        self.events.publish(MigrationEvent(
            kind=MIGRATION_EVENT_KIND_STAGE_RECEIVED, migration_id=header.migration_id, stage=header.stage,
            final=header.final, num_tokens=header.num_tokens, blocks=header.num_blocks,
            bytes=header.payload_bytes, timestamp=time.time()))

    def on_add(self, generation: Generation) -> None:
        """A migrated-in request: its staged tokens count as computed (no prefill cost for them)."""
        params = generation.params.kv_transfer_params or {}
        migration_id = params.get("llumlet_migration_id")
        if not migration_id:
            return
        staged = self.staging.take(str(migration_id))
        event = MigrationEvent(migration_id=str(migration_id), request_id=generation.tracking_id,
                               timestamp=time.time())
        if staged is None:
            event.kind = MIGRATION_EVENT_KIND_LOAD_FAILED
            event.error = "no staged KV for the migration; recomputing"
        else:
            event.kind = MIGRATION_EVENT_KIND_LOADED
            event.num_tokens = min(staged.num_tokens, int(params.get("llumlet_staged_tokens") or 0))
            generation.sim.cached_tokens = event.num_tokens
        self.events.publish(event)
