"""What the engine tells its llumlet about itself, from inside vLLM.

Load snapshots (scheduler side): every engine step, capture the load state (block pool, tracked
requests, preemptions) and hand it to a `SnapshotPump` that publishes `EngineSnapshot`s.
The handshake record (worker side, tensor-parallel rank 0): written once the KV cache exists.
See docs/connector.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from llumnix.engine.engine_snapshot import EngineState, capture_rows
from llumnix.engine.handshake import (
    HANDSHAKE_PATH_ENV,
    default_handshake_path,
    handshake_record,
    write_handshake,
)
from llumnix.engine.prefix_cache_report import PrefixCacheReporter
from llumnix.engine.snapshot_pump import SnapshotPump
from llumnix.engine.snapshots import SnapshotPublisher
from llumnix.engine.vllm_kv_events import KvEventFeed, KvEventTranslator

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from llumnix.engine.kv_blocks import KVLayout

logger = init_logger("vllm.llumnix")


class LoadTelemetry:
    """Publishes the scheduler's load state on `snapshot_addr`, with the prefix cache's changes read
    from vLLM's KV events at `kv_events_endpoint` (None: no prefix-cache report)."""

    def __init__(
        self,
        snapshot_addr: str,
        engine_id: str,
        block_size: int,
        idle_refresh_s: float,
        stats_interval_s: float,
        kv_events_endpoint: str | None = None,
    ) -> None:
        self._requests: Mapping[str, tuple[str, Request]] = {}
        self._manager: KVCacheManager | None = None
        self._preemptions_total = 0
        self._capture_seconds = 0.0
        self._captures = 0
        self._stats_interval_s = stats_interval_s
        self._stats_logged_at = time.monotonic()
        prefix_cache: PrefixCacheReporter | None = None
        self._kv_events: KvEventFeed | None = None
        if kv_events_endpoint is not None:
            prefix_cache = PrefixCacheReporter()
            self._kv_events = KvEventFeed(kv_events_endpoint, KvEventTranslator(prefix_cache, block_size))
        self._pump = SnapshotPump(
            SnapshotPublisher(snapshot_addr), engine_id, block_size, self._capture_idle,
            idle_refresh_s=idle_refresh_s, prefix_cache=prefix_cache,
        )

    def bind(self, manager: KVCacheManager, requests: Mapping[str, tuple[str, Request]]) -> None:
        """What a capture reads: vLLM's block manager and the connector's live table of tracked
        requests (engine request id -> (llumlet id, request))."""
        self._requests = requests
        self._manager = manager

    def step(self, scheduler_output: SchedulerOutput) -> None:
        """Publish the state of the step vLLM just scheduled."""
        self._preemptions_total += len(scheduler_output.preempted_req_ids)
        self._pump.submit(self._capture(scheduler_output.num_scheduled_tokens))
        if time.monotonic() - self._stats_logged_at >= self._stats_interval_s:
            self._log_stats()

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
        # vLLM admits a waiting request only while its `--watermark` share of the blocks stays free
        # (none by default); the load offers the room above it, as the simulator's instances do.
        watermark = self._manager.watermark_blocks
        state = EngineState(
            timestamp=time.time(),
            # vLLM reserves one block (the null block); its own usage metric leaves it out too.
            total_blocks=pool.num_gpu_blocks - 1 - watermark,
            free_blocks=max(0, pool.get_num_free_blocks() - watermark),
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

    def _log_stats(self) -> None:
        self._stats_logged_at = time.monotonic()
        # bench/snapshot_overhead.py parses this line.
        logger.info(
            "llumnix connector stats: snapshots=%d captures=%d capture_us=%.1f publish_us=%.1f",
            self._pump.published,
            self._captures,
            1e6 * self._capture_seconds / max(self._captures, 1),
            1e6 * self._pump.publish_seconds / max(self._pump.published, 1),
        )

    def close(self) -> None:
        self._log_stats()
        if self._kv_events is not None:
            self._kv_events.close()
        self._pump.close()


def write_engine_handshake(
    vllm_config: VllmConfig,
    engine_id: str,
    layout: KVLayout,
    path_setting: str | None,
    snapshot_addr: str | None,
    kv_address: str | None,
    kv_channels: list[str] | None,
    kv_secret: str | None,
) -> None:
    """Write the handshake record to `path_setting`, else $LLUMNIX_HANDSHAKE_PATH, else next to an
    ipc snapshot socket; nowhere when none of them applies."""
    path_setting = path_setting or os.environ.get(HANDSHAKE_PATH_ENV)
    path = Path(path_setting) if path_setting else default_handshake_path(snapshot_addr)
    if path is None:
        return
    cache_config = vllm_config.cache_config
    resolve_layout = getattr(cache_config, "get_resolved_kv_cache_layout", None)
    record = handshake_record(
        engine_id=engine_id,
        model=vllm_config.model_config.model,
        block_size=cache_config.block_size,
        layout=layout,
        memory_layout=resolve_layout().name if resolve_layout else "unknown",
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        pipeline_parallel_size=vllm_config.parallel_config.pipeline_parallel_size,
        kv_address=kv_address,
        kv_channels=kv_channels,
        kv_secret=kv_secret,
    )
    write_handshake(path, record)
    logger.info("llumnix connector: handshake record in %s", path)
