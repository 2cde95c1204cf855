"""Scheduler-side bookkeeping of live migration in the connector (no vLLM import, so it is unit-tested
alone): which requests the llumlet may export, the commands it sent, and which blocks each stage covers.

Commands arrive on the command server's thread (`handle`); the engine thread turns them into
`ExportItem`s at the next step (`take_stages`) or when the request finishes (`final_export`).
Full blocks are sent once; the partial tail block is sent again by the next stage, because the
request keeps writing into it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from llumnix.v1.kv_transfer_pb2 import (
    EngineCommand,
    EngineCommandReply,
    ExportFinal,
    ExportStage,
    KVChannel,
    OpenChannel,
)

OK = EngineCommandReply(ok=True)


@dataclasses.dataclass(frozen=True)
class Destination:
    kv_address: str
    transport: str
    channel: KVChannel | None = dataclasses.field(default=None, compare=False)
    """A pair channel's rendezvous (gloo, nccl); its id tells destinations apart."""
    channel_id: str = ""


@dataclasses.dataclass(frozen=True)
class ExportItem:
    """Worker work order: copy `block_ids` (the request's blocks from index `first_block` on) after this
    step's forward and send them as stage `stage` of `migration_id`."""

    migration_id: str
    request_id: str  # the llumlet's id
    engine_request_id: str
    stage: int
    final: bool
    first_block: int
    block_ids: tuple[int, ...]
    num_tokens: int  # KV valid after this step, cumulative
    destination: Destination
    kv_key: bytes
    """The migration's key, which the destination's receiver requires on every frame."""


@dataclasses.dataclass(frozen=True)
class LoadItem:
    """Worker work order: before this step's forward, write staged tokens [start_token, end_token) of
    `migration_id` into the request's blocks (`block_ids` are all of them, in order)."""

    migration_id: str
    request_id: str
    engine_request_id: str
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]


@dataclasses.dataclass
class _Export:
    request_id: str
    destination: Destination
    kv_key: bytes
    exported_tokens: int = 0  # block-aligned: tokens whose blocks were sent full
    stages: int = 0
    final: bool = False


@dataclasses.dataclass(frozen=True)
class _StageRequest:
    migration_id: str
    request_id: str


def _destination(command: ExportStage | ExportFinal) -> Destination:
    transport = command.transport or "tcp"
    if transport == "tcp":
        return Destination(kv_address=command.kv_address, transport=transport)
    channel = KVChannel()
    channel.CopyFrom(command.channel)
    return Destination(kv_address=command.kv_address, transport=transport, channel=channel,
                       channel_id=channel.channel_id)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class MigrationPlan:
    def __init__(self, block_size: int, on_drop: Callable[[str], None],
                 open_channel: Callable[[OpenChannel], KVChannel] | None = None) -> None:
        self.block_size = block_size
        self._on_drop = on_drop  # forwards DropStaging to the worker side
        self._open_channel = open_channel  # OpenChannel: the destination's pair channel rendezvous
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}  # llumlet id -> engine request id, requests running here
        self._exports: dict[str, _Export] = {}  # migration id -> progress
        self._stage_requests: list[_StageRequest] = []

    # -------------------------------------------------------------- request lifecycle (engine thread)

    def track(self, request_id: str, engine_request_id: str) -> None:
        with self._lock:
            self._live[request_id] = engine_request_id

    def final_export(self, request_id: str, engine_request_id: str, block_ids: list[int],
                     num_computed_tokens: int) -> ExportItem | None:
        """The request finished: the final stage when an ExportFinal is registered for it (the caller
        then delays freeing its blocks), else None. Forgets every migration of the request."""
        with self._lock:
            self._live.pop(request_id, None)
            mine = [key for key, export in self._exports.items() if export.request_id == request_id]
            exports = {key: self._exports.pop(key) for key in mine}
            self._stage_requests = [s for s in self._stage_requests if s.request_id != request_id]
        finals = [(key, export) for key, export in exports.items() if export.final]
        if not finals:
            return None
        migration_id, export = finals[-1]
        return self._item(migration_id, export, engine_request_id, block_ids, num_computed_tokens, True)

    def take_stages(self, lookup: Callable[[str], tuple[list[int], int] | None]) -> list[ExportItem]:
        """Stages requested since the last step. `lookup(engine_request_id)` gives (block ids, KV tokens
        valid after this step) for a request scheduled in this step, else None (the stage waits)."""
        with self._lock:
            if not self._stage_requests:
                return []
            pending, self._stage_requests = self._stage_requests, []
            work = [(s, self._exports.get(s.migration_id), self._live.get(s.request_id)) for s in pending]
        items, waiting = [], []
        for stage_request, export, engine_request_id in work:
            if export is None or engine_request_id is None:
                continue  # cancelled, or the request finished in between (the llumlet sees that)
            found = lookup(engine_request_id)
            if found is None:
                waiting.append(stage_request)  # not scheduled this step (preempted): next step
                continue
            block_ids, num_tokens = found
            items.append(self._item(stage_request.migration_id, export, engine_request_id, block_ids,
                                    num_tokens, False))
        if waiting:
            with self._lock:
                self._stage_requests[:0] = waiting
        return items

    def _item(self, migration_id: str, export: _Export, engine_request_id: str, block_ids: list[int],
              num_tokens: int, final: bool) -> ExportItem:
        first = export.exported_tokens // self.block_size
        last = min(_blocks_for(num_tokens, self.block_size), len(block_ids))
        export.stages += 1
        export.exported_tokens = max(export.exported_tokens, num_tokens // self.block_size * self.block_size)
        return ExportItem(
            migration_id=migration_id,
            request_id=export.request_id,
            engine_request_id=engine_request_id,
            stage=export.stages,
            final=final,
            first_block=first,
            block_ids=tuple(block_ids[first:last]),
            num_tokens=num_tokens,
            destination=export.destination,
            kv_key=export.kv_key,
        )

    # -------------------------------------------------------------- commands (command server thread)

    def handle(self, command: EngineCommand) -> EngineCommandReply:
        kind = command.WhichOneof("command")
        if kind in ("export_stage", "export_final"):
            body = getattr(command, kind)
            if not body.migration_id or not body.kv_address:
                return EngineCommandReply(ok=False, error=f"{kind} needs migration_id and kv_address")
            if body.transport not in ("", "tcp") and body.channel.backend != body.transport:
                return EngineCommandReply(ok=False, error=f"{kind} over {body.transport} needs its channel")
            with self._lock:
                if body.request_id not in self._live:
                    return EngineCommandReply(ok=False, error=f"unknown request {body.request_id!r}")
                export = self._exports.setdefault(
                    body.migration_id, _Export(body.request_id, _destination(body), body.kv_key)
                )
                if export.request_id != body.request_id:
                    return EngineCommandReply(
                        ok=False, error=f"migration {body.migration_id} exports {export.request_id!r}"
                    )
                if kind == "export_final":
                    export.final = True
                else:
                    self._stage_requests.append(_StageRequest(body.migration_id, body.request_id))
            return OK
        if kind == "cancel_export":
            migration_id = command.cancel_export.migration_id
            with self._lock:
                self._exports.pop(migration_id, None)
                self._stage_requests = [s for s in self._stage_requests if s.migration_id != migration_id]
            return OK
        if kind == "drop_staging":
            self._on_drop(command.drop_staging.migration_id)
            return OK
        if kind == "open_channel":
            if self._open_channel is None:
                return EngineCommandReply(ok=False, error="this engine opens no pair channels")
            return EngineCommandReply(ok=True, channel=self._open_channel(command.open_channel))
        return EngineCommandReply(ok=False, error="empty engine command")
