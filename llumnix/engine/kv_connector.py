"""The llumnix KV connector: an out-of-tree vLLM v1 connector that vLLM loads with

    --kv-transfer-config '{"kv_connector": "LlumnixConnector",
                           "kv_connector_module_path": "llumnix.engine.kv_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"snapshot_addr": "ipc:///run/llumnix/engine.sock"}}'

Scheduler side: every engine step, capture the load state (block pool, tracked requests) and hand it
to a `SnapshotPump` that publishes `EngineSnapshot`s to the llumlet. Requests are tracked by
`kv_transfer_params["llumlet_id"]`, because vLLM rewrites the request ids the API server sees.
It also answers the llumlet's migration commands (llumnix/engine/engine_channel.py) and plans stages
(llumnix/engine/kv_migration_plan.py): ExportStage copies a running request's new blocks after the next step,
ExportFinal keeps a finishing request's blocks (delayed free) until the rest is copied out.
A migrated-in request (`kv_transfer_params["llumlet_migration_id"]`, `"llumlet_staged_tokens"`)
reports its staged tokens as already computed, so only the last token is recomputed.
Worker side: wrap the KV cache in a `KVBlockCopier`, copy stages out and send them to the destination
engine, receive stages into staging and load them, and write the handshake record.
See docs/connector.md and docs/migration.md.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from llumnix.engine.engine_channel import (
    EngineCommandServer,
    MigrationEventPublisher,
    control_address,
    events_address,
)
from llumnix.engine.engine_snapshot import EngineState, capture_rows
from llumnix.engine.handshake import (
    HANDSHAKE_PATH_ENV,
    default_handshake_path,
    handshake_record,
    write_handshake,
)
from llumnix.engine.kv_blocks import KVBlockCopier
from llumnix.engine.kv_migration_plan import ExportItem, LoadItem, MigrationPlan
from llumnix.engine.kv_migration_worker import StageSender, StagingService
from llumnix.engine.snapshot_pump import SnapshotPump
from llumnix.engine.snapshots import SNAPSHOT_ADDR_ENV, SnapshotPublisher
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_LOAD_FAILED,
    MIGRATION_EVENT_KIND_LOADED,
    MigrationEvent,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.llumnix")

ENGINE_ID_ENV = "LLUMNIX_ENGINE_ID"
KV_HOST_ENV = "LLUMNIX_KV_HOST"


def llumlet_id(request: Request) -> str:
    """The llumlet's id for a request; the engine's own id when no llumlet tagged it."""
    return (request.kv_transfer_params or {}).get("llumlet_id") or request.request_id


def staged_load_end(params: dict[str, Any], num_tokens: int) -> int:
    """Tokens of a migrated-in request whose KV comes from staging: all staged ones but at most
    `num_tokens - 1`, because the last token must run through the model to give the next logits."""
    if not params.get("llumlet_migration_id"):
        return 0
    return max(0, min(int(params.get("llumlet_staged_tokens") or 0), num_tokens - 1))


@dataclasses.dataclass
class LlumnixConnectorMetadata(KVConnectorMetadata):
    exports: list[ExportItem] = dataclasses.field(default_factory=list)
    loads: list[LoadItem] = dataclasses.field(default_factory=list)
    drops: list[str] = dataclasses.field(default_factory=list)


class LlumnixConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        self._block_size = vllm_config.cache_config.block_size
        self._snapshot_addr: str | None = extra("snapshot_addr", None) or os.environ.get(SNAPSHOT_ADDR_ENV)
        self._engine_id: str = extra("engine_id", None) or os.environ.get(ENGINE_ID_ENV) or (
            self._snapshot_addr or f"pid-{os.getpid()}"
        )

        # Scheduler side.
        self._requests: dict[str, tuple[str, Request]] = {}  # engine request id -> (llumlet id, request)
        self._preemptions_total = 0
        self._capture_seconds = 0.0
        self._captures = 0
        self._stats_interval_s = float(extra("stats_log_interval_s", 60.0))
        self._stats_logged_at = time.monotonic()
        self._pump: SnapshotPump | None = None
        self._manager: KVCacheManager | None = None
        self._drops: collections.deque[str] = collections.deque()  # DropStaging, for the worker
        self._plan = MigrationPlan(self._block_size, self._drops.append)
        self._pending_exports: list[ExportItem] = []
        self._pending_loads: dict[str, LoadItem] = {}  # engine request id -> load, until scheduled
        self._loaded: set[str] = set()  # engine request ids whose staging was already used
        self._commands: EngineCommandServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._snapshot_addr:
                self._pump = SnapshotPump(
                    SnapshotPublisher(self._snapshot_addr),
                    self._engine_id,
                    self._block_size,
                    self._capture_idle,
                    idle_refresh_s=float(extra("idle_refresh_s", 0.2)),
                )
                logger.info("llumnix connector: publishing snapshots on %s as %s",
                            self._snapshot_addr, self._engine_id)
                address = self._channel_address(control_address, "control_addr")
                if address:
                    self._commands = EngineCommandServer(address, self._plan.handle)
                    logger.info("llumnix connector: migration commands on %s", address)
            else:
                logger.warning("llumnix connector: no snapshot_addr and no %s; not publishing load",
                               SNAPSHOT_ADDR_ENV)

        # Worker side.
        self._copier: KVBlockCopier | None = None
        self._events: MigrationEventPublisher | None = None
        self._sender: StageSender | None = None
        self._staging: StagingService | None = None
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()

    def _channel_address(self, derive: Callable[[str, str | None], str], key: str) -> str | None:
        """The migration channel's address (explicit, else next to an ipc snapshot socket); None, with a
        warning, when neither exists: the engine then serves without migration."""
        try:
            override = self._kv_transfer_config.get_from_extra_config(key, None)
            return derive(self._snapshot_addr or "", override)
        except ValueError as exc:
            logger.warning("llumnix connector: live migration disabled: %s", exc)
            return None

    @property
    def requires_kv_delivery(self) -> bool:
        # Stages are copied out within the step that scheduled them and the final stage only happens
        # for a finished request, so a preempted request never has a hand-off in flight.
        return False

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        key = llumlet_id(request)
        self._requests[request.request_id] = (key, request)
        self._plan.track(key, request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._loaded:
            return 0, False  # preempted after its load: staging is gone, recompute
        end = staged_load_end(request.kv_transfer_params or {}, request.num_tokens)
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params or {}
        end = staged_load_end(params, request.num_tokens)
        # Block ids are filled in when the request is scheduled (build_connector_meta).
        self._pending_loads[request.request_id] = LoadItem(
            migration_id=params["llumlet_migration_id"],
            request_id=llumlet_id(request),
            engine_request_id=request.request_id,
            start_token=end - num_external_tokens,
            end_token=end,
            block_ids=(),
            zero_kv=bool(params.get("llumlet_zero_kv", False)),
        )

    def _capture(self, scheduled: dict[str, int]) -> EngineState:
        started = time.perf_counter()
        assert self._manager is not None
        pool = self._manager.block_pool
        blocks_of = self._manager.coordinator.get_blocks
        rows = capture_rows(
            list(self._requests.items()),
            scheduled,
            lambda engine_id: len(blocks_of(engine_id)[0]),
            RequestStatus.RUNNING,
            RequestStatus.PREEMPTED,
        )
        state = EngineState(
            timestamp=time.time(),
            # vLLM reserves one block (the null block); its own usage metric leaves it out too.
            total_blocks=pool.num_gpu_blocks - 1,
            free_blocks=pool.get_num_free_blocks(),
            preemptions_total=self._preemptions_total,
            requests=rows,
        )
        self._capture_seconds += time.perf_counter() - started
        self._captures += 1
        return state

    def _capture_idle(self) -> EngineState | None:
        # Called from the pump's thread; the block manager is bound before the first request.
        if self._manager is None:
            return None
        return self._capture({})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._preemptions_total += len(scheduler_output.preempted_req_ids)
        if self._pump is not None:
            self._pump.submit(self._capture(scheduler_output.num_scheduled_tokens))
            if time.monotonic() - self._stats_logged_at >= self._stats_interval_s:
                self._log_stats()
        meta = LlumnixConnectorMetadata(exports=self._pending_exports)
        self._pending_exports = []
        scheduled = scheduler_output.num_scheduled_tokens

        def running(engine_id: str) -> tuple[list[int], int] | None:
            if engine_id not in scheduled or engine_id not in self._requests or self._manager is None:
                return None
            request = self._requests[engine_id][1]
            # KV valid once this step's forward ran: computed so far + scheduled now.
            valid = request.num_computed_tokens + scheduled[engine_id]
            return list(self._manager.get_block_ids(engine_id)[0]), valid

        meta.exports.extend(self._plan.take_stages(running))
        for new_request in scheduler_output.scheduled_new_reqs:
            load = self._pending_loads.pop(new_request.req_id, None)
            if load is not None:
                meta.loads.append(dataclasses.replace(load, block_ids=tuple(new_request.block_ids[0])))
                self._loaded.add(new_request.req_id)
        while self._drops:
            meta.drops.append(self._drops.popleft())
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key, _ = self._requests.pop(request.request_id, (llumlet_id(request), request))
        self._pending_loads.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        final = self._plan.final_export(key, request.request_id, block_ids, request.num_computed_tokens)
        if final is None:
            return False, None
        self._pending_exports.append(final)
        logger.info("llumnix migration %s: final stage of %s queued (%d tokens, %d blocks)",
                    final.migration_id, key, final.num_tokens, len(final.block_ids))
        return True, {"llumlet_migration_id": final.migration_id, "llumlet_final_tokens": final.num_tokens}

    def _log_stats(self) -> None:
        assert self._pump is not None
        self._stats_logged_at = time.monotonic()
        # bench/snapshot_overhead.py parses this line.
        logger.info(
            "llumnix connector stats: snapshots=%d captures=%d capture_us=%.1f publish_us=%.1f",
            self._pump.published,
            self._captures,
            1e6 * self._capture_seconds / max(self._captures, 1),
            1e6 * self._pump.publish_seconds / max(self._pump.published, 1),
        )

    def shutdown(self) -> None:
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        if self._pump is not None:
            self._log_stats()
            self._pump.close()
            self._pump = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._events is not None:
            self._events.close()
            self._events = None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._copier = KVBlockCopier(kv_caches, self._kv_cache_config.num_blocks)
        layout = self._copier.layout
        logger.info("llumnix connector: %d KV layers, page %s %s, %d blocks x %d kernel blocks",
                    len(layout.layer_names), layout.page_shape, layout.dtype, layout.num_blocks,
                    layout.kernel_blocks_per_block)
        if get_tensor_model_parallel_rank() == 0:
            self._start_migration_worker()
            self._write_handshake()

    def _start_migration_worker(self) -> None:
        assert self._copier is not None
        extra = self._kv_transfer_config.get_from_extra_config
        address = self._channel_address(events_address, "events_addr")
        if address is None:
            return
        self._events = MigrationEventPublisher(address)
        layout = self._copier.layout
        self._sender = StageSender(layout.bytes_per_block, layout.dtype, self._events.publish,
                                   timeout_s=float(extra("kv_send_timeout_s", 10.0)))
        self._staging = StagingService(
            transport=extra("kv_transport", "tcp"),
            host=extra("kv_host", None) or os.environ.get(KV_HOST_ENV) or "127.0.0.1",
            port=int(extra("kv_port", 0)),
            bytes_per_block=layout.bytes_per_block,
            dtype=layout.dtype,
            lease_s=float(extra("staging_lease_s", 60.0)),
            publish=self._events.publish,
        )
        self._staging.start()
        logger.info("llumnix connector: migration events on %s, KV receiver on %s",
                    address, self._staging.address)

    def _write_handshake(self) -> None:
        path_setting = self._kv_transfer_config.get_from_extra_config("handshake_path", None)
        path_setting = path_setting or os.environ.get(HANDSHAKE_PATH_ENV)
        path = Path(path_setting) if path_setting else default_handshake_path(self._snapshot_addr)
        if path is None or self._copier is None:
            return
        config = self._vllm_config
        cache_config = config.cache_config
        resolve_layout = getattr(cache_config, "get_resolved_kv_cache_layout", None)
        record = handshake_record(
            engine_id=self._engine_id,
            model=config.model_config.model,
            block_size=cache_config.block_size,
            layout=self._copier.layout,
            memory_layout=resolve_layout().name if resolve_layout else "unknown",
            tensor_parallel_size=config.parallel_config.tensor_parallel_size,
            pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
            kv_address=self._staging.address if self._staging else None,
            kv_transport=self._staging.transport if self._staging else None,
        )
        write_handshake(path, record)
        logger.info("llumnix connector: handshake record in %s", path)

    def _worker_meta(self) -> LlumnixConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LlumnixConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._worker_meta()
        if meta is None or self._staging is None:
            return
        for migration_id in meta.drops:
            self._staging.drop(migration_id)
        self._staging.expire()
        for load in meta.loads:
            self._load(load)

    def _load(self, load: LoadItem) -> None:
        assert self._copier is not None and self._staging is not None
        started = time.perf_counter()
        first, last = load.start_token // self._block_size, -(-load.end_token // self._block_size)
        block_ids = load.block_ids[first:last]
        staged = self._staging.take(load.migration_id)
        error = ""
        if staged is None:
            error = "no staging (never sent, dropped or lease expired)"
        elif staged.num_tokens < load.end_token:
            error = f"staging holds {staged.num_tokens} tokens, the request needs {load.end_token}"
        if not error:
            try:
                raw = staged.blocks(first, last)
                buffer = self._as_buffer(raw, len(block_ids))
                if load.zero_kv:
                    buffer = torch.zeros_like(buffer)
                self._copier.copy_in_block_major(block_ids, buffer)
            except (KeyError, ValueError) as exc:
                error = str(exc)
        if error:
            # vLLM recomputes these blocks (kv_load_failure_policy "recompute") instead of using them.
            self._load_errors.update(block_ids)
            logger.warning("llumnix migration %s: load of %s failed, recomputing: %s",
                           load.migration_id, load.request_id, error)
        self._publish(MigrationEvent(
            kind=MIGRATION_EVENT_KIND_LOAD_FAILED if error else MIGRATION_EVENT_KIND_LOADED,
            migration_id=load.migration_id, request_id=load.request_id,
            num_tokens=0 if error else load.end_token, blocks=len(block_ids),
            bytes=0 if error else len(block_ids) * self._copier.layout.bytes_per_block,
            copy_ms=1e3 * (time.perf_counter() - started), error=error, timestamp=time.time(),
        ))

    def _as_buffer(self, raw: Any, num_blocks: int) -> torch.Tensor:
        """Staged bytes as a block-major buffer of the engine's layout (no copy for CPU bytes)."""
        assert self._copier is not None
        dtype = getattr(torch, self._copier.layout.dtype)
        flat = raw if isinstance(raw, torch.Tensor) else torch.frombuffer(raw, dtype=torch.uint8)
        return flat.view(dtype).reshape(self._copier.block_major_shape(num_blocks))

    def _publish(self, event: MigrationEvent) -> None:
        if self._events is not None:
            self._events.publish(event)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # A final stage holds a finished request's blocks, which no forward writes any more: copied out
        # before this step's forward rather than after it, the forward is not part of the downtime.
        self._copy_exports(final=True)

    def wait_for_save(self) -> None:
        self._copy_exports(final=False)

    def _copy_exports(self, final: bool) -> None:
        meta = self._worker_meta()
        if meta is None or not meta.exports:
            return
        assert self._copier is not None
        for item in meta.exports:
            if item.final != final:
                continue
            # Copied on the engine thread, a live stage right after the forward that wrote its KV, so
            # the blocks can be reused (or, for the final stage, freed) as soon as this returns.
            started = time.perf_counter()
            buffer = self._copier.copy_out_block_major(item.block_ids)
            copy_ms = 1e3 * (time.perf_counter() - started)
            if self._sender is not None:
                self._sender.submit(item, buffer, copy_ms)
            if item.final:
                self._finished_sending.add(item.engine_request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_sending = self._finished_sending, set()
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
