"""The llumnix KV connector: an out-of-tree vLLM v1 connector that vLLM loads with

    --kv-transfer-config '{"kv_connector": "LlumnixConnector",
                           "kv_connector_module_path": "llumlet.kv_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"snapshot_addr": "ipc:///run/llumnix/engine.sock"}}'

Scheduler side: every engine step, capture the load state (block pool, tracked requests) and hand it
to a `SnapshotPump` that publishes `EngineSnapshot`s to the llumlet. Requests are tracked by
`kv_transfer_params["llumlet_id"]`, because vLLM rewrites the request ids the API server sees.
Worker side: wrap the KV cache in a `KVBlockCopier` and write the handshake record.
Export on finish: a request tagged `kv_transfer_params["llumlet_export"]` keeps its blocks after it
finishes until the worker has copied them to `kv_export_dir` (delayed free), the path a final
migration stage takes. See docs/connector.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
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

from llumlet.engine_snapshot import EngineState, capture_rows
from llumlet.handshake import HANDSHAKE_PATH_ENV, default_handshake_path, handshake_record, write_handshake
from llumlet.kv_blocks import KVBlockCopier
from llumlet.snapshot_pump import SnapshotPump
from llumlet.snapshots import SNAPSHOT_ADDR_ENV, SnapshotPublisher

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.llumnix")

ENGINE_ID_ENV = "LLUMNIX_ENGINE_ID"


def llumlet_id(request: Request) -> str:
    """The llumlet's id for a request; the engine's own id when no llumlet tagged it."""
    return (request.kv_transfer_params or {}).get("llumlet_id") or request.request_id


@dataclasses.dataclass(frozen=True)
class ExportItem:
    request_id: str
    engine_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclasses.dataclass
class LlumnixConnectorMetadata(KVConnectorMetadata):
    exports: list[ExportItem] = dataclasses.field(default_factory=list)


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
        export_dir = extra("kv_export_dir", None)
        self._export_dir = Path(export_dir) if export_dir else None

        # Scheduler side.
        self._requests: dict[str, tuple[str, Request]] = {}  # engine request id -> (llumlet id, request)
        self._preemptions_total = 0
        self._pending_exports: list[ExportItem] = []
        self._capture_seconds = 0.0
        self._captures = 0
        self._stats_interval_s = float(extra("stats_log_interval_s", 60.0))
        self._stats_logged_at = time.monotonic()
        self._pump: SnapshotPump | None = None
        self._manager: KVCacheManager | None = None
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
            else:
                logger.warning("llumnix connector: no snapshot_addr and no %s; not publishing load",
                               SNAPSHOT_ADDR_ENV)

        # Worker side.
        self._copier: KVBlockCopier | None = None
        self._finished_sending: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # Exports only happen for finished requests; a preempted request has nothing in flight.
        return False

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = (llumlet_id(request), request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

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
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key, _ = self._requests.pop(request.request_id, (llumlet_id(request), request))
        params = request.kv_transfer_params or {}
        if not (params.get("llumlet_export") and self._export_dir and block_ids):
            return False, None
        self._pending_exports.append(
            ExportItem(key, request.request_id, tuple(block_ids), request.num_computed_tokens)
        )
        return True, {"llumlet_export_blocks": len(block_ids)}

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
        if self._pump is None:
            return
        self._log_stats()
        self._pump.close()
        self._pump = None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._copier = KVBlockCopier(kv_caches, self._kv_cache_config.num_blocks)
        layout = self._copier.layout
        logger.info("llumnix connector: %d KV layers, page %s %s, %d blocks x %d kernel blocks",
                    len(layout.layer_names), layout.page_shape, layout.dtype, layout.num_blocks,
                    layout.kernel_blocks_per_block)
        self._write_handshake()

    def _write_handshake(self) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        path_setting = self._kv_transfer_config.get_from_extra_config("handshake_path", None)
        path_setting = path_setting or os.environ.get(HANDSHAKE_PATH_ENV)
        path = Path(path_setting) if path_setting else default_handshake_path(self._snapshot_addr)
        if path is None or self._copier is None or get_tensor_model_parallel_rank() != 0:
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
        )
        write_handshake(path, record)
        logger.info("llumnix connector: handshake record in %s", path)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, LlumnixConnectorMetadata) or not meta.exports:
            return
        assert self._copier is not None and self._export_dir is not None
        for item in meta.exports:
            self._export(item)
            self._finished_sending.add(item.engine_request_id)

    def _export(self, item: ExportItem) -> None:
        from safetensors.torch import save_file

        started = time.perf_counter()
        buffer = self._copier.copy_out(item.block_ids)
        self._export_dir.mkdir(parents=True, exist_ok=True)
        base = self._export_dir / item.request_id
        tmp = base.with_name(base.name + ".tmp")
        save_file({"kv": buffer.cpu()}, str(tmp))
        os.replace(tmp, base.with_name(base.name + ".safetensors"))
        info = {
            **dataclasses.asdict(item),
            "block_size": self._block_size,
            "layout": self._copier.layout.to_record(),
            "bytes": buffer.numel() * buffer.element_size(),
            "copy_ms": round(1e3 * (time.perf_counter() - started), 3),
        }
        base.with_name(base.name + ".json").write_text(json.dumps(info) + "\n")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_sending = self._finished_sending, set()
        return done or None, None
