"""The connector's worker side: wraps the KV cache in a `KVBlockCopier`, copies stages out and sends them
to the destination engine (`StageSender`), receives stages into staging (`StagingService`) and loads
them into a migrated-in request's blocks. Outcomes go to the llumlet as `MigrationEvent`s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from llumnix.engine.engine_channel import MigrationEventPublisher
from llumnix.engine.kv_blocks import KVBlockCopier, KVLayout
from llumnix.engine.kv_migration_plan import ExportItem, LoadItem
from llumnix.engine.kv_migration_worker import StageSender, StagingService
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_LOAD_FAILED,
    MIGRATION_EVENT_KIND_LOADED,
    MigrationEvent,
)

logger = logging.getLogger("vllm.llumnix")


class ConnectorWorker:
    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._copier: KVBlockCopier | None = None
        self._device: torch.device | None = None
        self._events: MigrationEventPublisher | None = None
        self._sender: StageSender | None = None
        self._staging: StagingService | None = None
        self._finished_sending: set[str] = set()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
        self._copier = KVBlockCopier(kv_caches, num_blocks)
        self._device = next(iter(kv_caches.values())).device
        layout = self._copier.layout
        logger.info("llumnix connector: %d KV layers, page %s %s, %d blocks x %d kernel blocks",
                    len(layout.layer_names), layout.page_shape, layout.dtype, layout.num_blocks,
                    layout.kernel_blocks_per_block)
        return layout

    def start_migration(self, events_addr: str, host: str, port: int, send_timeout_s: float,
                        staging_lease_s: float) -> None:
        """Publish events on `events_addr`, send stages, and receive stages (every channel) at host:port."""
        assert self._copier is not None
        self._events = MigrationEventPublisher(events_addr)
        layout = self._copier.layout
        self._sender = StageSender(layout.bytes_per_block, layout.dtype, self._events.publish,
                                   timeout_s=send_timeout_s, idle_s=staging_lease_s)
        self._staging = StagingService(
            host=host,
            port=port,
            bytes_per_block=layout.bytes_per_block,
            dtype=layout.dtype,
            lease_s=staging_lease_s,
            publish=self._events.publish,
            device=self._device,
            timeout_s=send_timeout_s,
        )
        self._staging.start()
        logger.info("llumnix connector: migration events on %s, KV receiver on %s",
                    events_addr, self._staging.address)

    @property
    def kv_address(self) -> str | None:
        """Where peers send stages to this engine; None without migration."""
        return self._staging.address if self._staging else None

    @property
    def kv_secret(self) -> str | None:
        """What the KV receiver derives migration keys from; None without migration."""
        return self._staging.kv_secret if self._staging else None

    @property
    def kv_channels(self) -> list[str] | None:
        """The KV channels this engine receives and sends on; None without migration."""
        return self._staging.channels if self._staging else None

    def start_load(self, drops: Iterable[str], loads: Iterable[LoadItem]) -> None:
        if self._staging is None:
            return
        for migration_id in drops:
            self._staging.drop(migration_id)
        self._staging.expire()
        for load in loads:
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
                self._copier.copy_in_parts(block_ids, staged.parts(first, last))
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

    def _publish(self, event: MigrationEvent) -> None:
        if self._events is not None:
            self._events.publish(event)

    def copy_exports(self, exports: Iterable[ExportItem], final: bool) -> None:
        """Copy out and send the final stages (`final`) or the live ones."""
        for item in exports:
            if item.final != final:
                continue
            assert self._copier is not None
            # Copied on the engine thread, a live stage right after the forward that wrote its KV, so
            # the blocks can be reused (or, for the final stage, freed) as soon as this returns.
            started = time.perf_counter()
            buffer = self._copier.copy_out_block_major(item.block_ids)
            copy_ms = 1e3 * (time.perf_counter() - started)
            if self._sender is not None:
                self._sender.submit(item, buffer, copy_ms)
            if item.final:
                self._finished_sending.add(item.engine_request_id)

    def take_finished_sending(self) -> set[str]:
        """Engine request ids whose final stage was copied out since the last call: their blocks may go."""
        done, self._finished_sending = self._finished_sending, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._events is not None:
            self._events.close()
            self._events = None
