"""The llumnix KV connector: an out-of-tree vLLM v1 connector that vLLM loads with

    --kv-transfer-config '{"kv_connector": "LlumnixConnector",
                           "kv_connector_module_path": "llumnix.engine.kv_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"snapshot_addr": "ipc:///run/llumnix/engine.sock"}}'

vLLM's hooks, which read the settings and hand each call to the role's half: the scheduler side
(llumnix/engine/kv_connector_scheduler.py: request tracking, migration commands and plans, with load
snapshots from llumnix/engine/engine_telemetry.py) or the worker side
(llumnix/engine/kv_connector_worker.py: copying stages out, sending, staging and loading them; rank 0
also writes the handshake record). See docs/connector.md and docs/migration.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from llumnix.engine.engine_channel import control_address, events_address
from llumnix.engine.engine_telemetry import LoadTelemetry, write_engine_handshake
from llumnix.engine.kv_connector_scheduler import ConnectorScheduler, LlumnixConnectorMetadata
from llumnix.engine.kv_connector_worker import ConnectorWorker
from llumnix.engine.kv_transport_pair import ChannelRendezvous
from llumnix.engine.snapshots import SNAPSHOT_ADDR_ENV

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
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler()
        else:
            self._worker = ConnectorWorker(self._block_size)

    def _make_scheduler(self) -> ConnectorScheduler:
        if not self._snapshot_addr:
            logger.warning("llumnix connector: no snapshot_addr and no %s; not publishing load",
                           SNAPSHOT_ADDR_ENV)
            return ConnectorScheduler(self._block_size, telemetry=None, command_address=None)
        extra = self._kv_transfer_config.get_from_extra_config
        events = self._vllm_config.kv_events_config
        # With prefix caching and vLLM's ZMQ KV events on, the snapshots report the cached blocks.
        reports_cache = self._vllm_config.cache_config.enable_prefix_caching and events is not None \
            and events.enable_kv_cache_events and events.publisher == "zmq"
        telemetry = LoadTelemetry(
            self._snapshot_addr, self._engine_id, self._block_size,
            idle_refresh_s=float(extra("idle_refresh_s", 0.2)),
            stats_interval_s=float(extra("stats_log_interval_s", 60.0)),
            kv_events_endpoint=events.endpoint if reports_cache and events is not None else None,
        )
        logger.info("llumnix connector: publishing snapshots on %s as %s",
                    self._snapshot_addr, self._engine_id)
        rendezvous = ChannelRendezvous(self._kv_host(), lease_s=float(extra("staging_lease_s", 60.0)),
                                       timeout_s=float(extra("kv_send_timeout_s", 10.0)))
        return ConnectorScheduler(self._block_size, telemetry,
                                  self._channel_address(control_address, "control_addr"), rendezvous)

    def _kv_host(self) -> str:
        """Where this engine receives KV (and opens its pair channels' stores)."""
        configured = self._kv_transfer_config.get_from_extra_config("kv_host", None)
        return configured or os.environ.get(KV_HOST_ENV) or "127.0.0.1"

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

    @property
    def _scheduler_side(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler hook called on a worker's connector"
        return self._scheduler

    @property
    def _worker_side(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker hook called on the scheduler's connector"
        return self._worker

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        worker = self._worker_side
        layout = worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)
        if get_tensor_model_parallel_rank() != 0:
            return
        extra = self._kv_transfer_config.get_from_extra_config
        events_addr = self._channel_address(events_address, "events_addr")
        if events_addr is not None:
            worker.start_migration(
                events_addr,
                host=self._kv_host(),
                port=int(extra("kv_port", 0)),
                send_timeout_s=float(extra("kv_send_timeout_s", 10.0)),
                staging_lease_s=float(extra("staging_lease_s", 60.0)),
            )
        write_engine_handshake(
            self._vllm_config, self._engine_id, layout,
            path_setting=extra("handshake_path", None), snapshot_addr=self._snapshot_addr,
            kv_address=worker.kv_address, kv_channels=worker.kv_channels,
            kv_secret=worker.kv_secret,
        )

    def _worker_meta(self) -> LlumnixConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LlumnixConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._worker_meta()
        if meta is not None:
            self._worker_side.start_load(meta.drops, meta.loads)

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
        if meta is not None:
            self._worker_side.copy_exports(meta.exports, final)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side.take_finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_load_errors()
