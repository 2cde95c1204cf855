"""Worker-side machinery of live migration in the connector: sending copied-out stages to destination
engines off the engine thread (`StageSender`), and the destination's staging (`StagingService`: KV
receiver + `StagingStore` + lease reaper). Outcomes go to the llumlet as `MigrationEvent`s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from llumnix.engine.kv_migration_plan import Destination, ExportItem
from llumnix.engine.kv_staging import STAGING_REPORT_INTERVAL_S, StagedKV, StagingStore
from llumnix.engine.kv_transport import KV_FRAME_SCHEMA_VERSION, KVReceiver, KVSender
from llumnix.engine.kv_transport_factory import available_channels, make_receiver, make_sender
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGE_FAILED,
    MIGRATION_EVENT_KIND_STAGE_RECEIVED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    KVStageHeader,
    MigrationEvent,
)

log = logging.getLogger("vllm.llumnix")

PublishEvent = Callable[[MigrationEvent], None]
# (stage, its copied-out buffer, CUDA event marking the copy done or None on CPU, copy time in ms)
_Work = tuple[ExportItem, torch.Tensor, Any, float]


def transfer_payload(buffer: torch.Tensor, transport: str) -> Any:
    """What a sender of `transport` takes: the buffer's bytes, flat uint8 (a memoryview of the CPU
    tensor for tcp, the CPU tensor for gloo, the device tensor for nccl; no copy on the engine's
    device). A CUDA buffer is copied to page-locked host memory (from torch's caching host allocator):
    on an H200 host that copy runs at ~50 GiB/s, into fresh pageable memory at 1.5 (docs/gpu.md)."""
    flat = buffer.contiguous().view(torch.uint8).reshape(-1)
    if transport == "nccl":
        return flat
    host = flat
    if flat.is_cuda:
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(flat)
    return host if transport == "gloo" else memoryview(host.numpy())


class StageSender:
    """One sender thread per destination engine for tcp, per migration for a pair channel (each has its
    own), so a slow peer never delays the engine or another destination; stages of one migration go
    out in order on one connection. A pair channel's lane ends after the migration's final stage, or
    after `idle_s` without a stage (a cancelled migration), closing its pair."""

    def __init__(self, bytes_per_block: int, dtype: str, publish: PublishEvent, timeout_s: float,
                 idle_s: float = 60.0) -> None:
        self._bytes_per_block = bytes_per_block
        self._dtype = dtype
        self._publish = publish
        self._timeout_s = timeout_s
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._lanes: dict[Destination, queue.Queue[_Work | None]] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, item: ExportItem, buffer: torch.Tensor, copy_ms: float) -> None:
        # A device copy is queued on the engine's stream: the sender thread waits for this event.
        ready = None
        if buffer.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        destination = item.destination
        with self._lock:
            lane = self._lanes.get(destination)
            if lane is None:
                lane = self._lanes[destination] = queue.Queue()
                thread = threading.Thread(target=self._run, args=(destination, lane),
                                          name="llumnix-kv-send", daemon=True)
                thread.start()
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            lane.put((item, buffer, ready, copy_ms))
            if item.final and destination.channel is not None:
                lane.put(None)
                del self._lanes[destination]

    def _next(self, destination: Destination, lane: queue.Queue[_Work | None]) -> _Work | None:
        if destination.channel is None:
            return lane.get()
        while True:
            try:
                return lane.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if lane.empty():
                        if self._lanes.get(destination) is lane:
                            del self._lanes[destination]
                        return None

    def _run(self, destination: Destination, lane: queue.Queue[_Work | None]) -> None:
        sender: KVSender | None = None
        while (work := self._next(destination, lane)) is not None:
            item, buffer, ready, copy_ms = work
            started = time.perf_counter()
            error = ""
            try:
                if ready is not None:
                    ready.synchronize()
                if sender is None:
                    sender = make_sender(destination.transport, destination.kv_address,
                                         timeout_s=self._timeout_s, channel=destination.channel)
                payload = transfer_payload(buffer, destination.transport)
                sender.send(self._header(item), payload)
            except Exception as exc:  # every failure becomes a STAGE_FAILED event for the llumlet
                error = f"{type(exc).__name__}: {exc}"
                log.warning("llumnix migration %s stage %d to %s failed: %s", item.migration_id,
                            item.stage, destination.kv_address, error)
            self._publish(MigrationEvent(
                kind=MIGRATION_EVENT_KIND_STAGE_FAILED if error else MIGRATION_EVENT_KIND_STAGE_SENT,
                migration_id=item.migration_id, request_id=item.request_id, stage=item.stage,
                final=item.final, num_tokens=item.num_tokens, blocks=len(item.block_ids),
                bytes=len(item.block_ids) * self._bytes_per_block, copy_ms=copy_ms,
                send_ms=1e3 * (time.perf_counter() - started), error=error, timestamp=time.time(),
            ))
        if sender is not None:
            sender.close()

    def _header(self, item: ExportItem) -> KVStageHeader:
        return KVStageHeader(
            schema_version=KV_FRAME_SCHEMA_VERSION, migration_id=item.migration_id, stage=item.stage,
            final=item.final, first_block=item.first_block, num_blocks=len(item.block_ids),
            num_tokens=item.num_tokens, payload_bytes=len(item.block_ids) * self._bytes_per_block,
            bytes_per_block=self._bytes_per_block, dtype=self._dtype, kv_key=item.kv_key,
        )

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.put(None)
        for thread in self._threads:
            thread.join(timeout=self._timeout_s)


class StagingService:
    """The destination engine's KV receiver and staging. Staging is dropped when loaded, on
    DropStaging, or when its lease runs out (checked every engine step and by a reaper thread, so an
    idle engine frees it too). What it holds goes to the llumlet as STAGING_HELD events, on every
    change and from the reaper every `STAGING_REPORT_INTERVAL_S`."""

    def __init__(self, host: str, port: int, bytes_per_block: int, dtype: str, lease_s: float,
                 publish: PublishEvent, device: Any = None, timeout_s: float = 10.0) -> None:
        self.store = StagingStore(bytes_per_block, dtype, lease_s, publish=publish)
        self._publish = publish
        self.receiver: KVReceiver = make_receiver(host=host, port=port, staging=self.store,
                                                  on_stage=self._received, device=device, timeout_s=timeout_s)
        self.channels = available_channels(device)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="llumnix-staging-lease", daemon=True)

    @property
    def address(self) -> str:
        return self.receiver.address

    @property
    def kv_secret(self) -> str:
        """What the receiver derives migration keys from (for the handshake record)."""
        return self.receiver.kv_secret

    def start(self) -> None:
        self.receiver.start()
        self._reaper.start()

    def _received(self, header: KVStageHeader) -> None:
        self._publish(MigrationEvent(
            kind=MIGRATION_EVENT_KIND_STAGE_RECEIVED, migration_id=header.migration_id,
            stage=header.stage, final=header.final, num_tokens=self.store.staged_tokens(header.migration_id),
            blocks=header.num_blocks, bytes=header.payload_bytes, timestamp=time.time(),
        ))

    def expire(self) -> None:
        for migration_id in self.store.expire():
            log.info("llumnix migration %s: staging lease expired, dropped", migration_id)

    def _reap(self) -> None:
        while not self._stop.wait(max(0.05, min(self.store.lease_s / 4, STAGING_REPORT_INTERVAL_S))):
            self.expire()
            self.store.report()

    def take(self, migration_id: str) -> StagedKV | None:
        return self.store.take(migration_id)

    def drop(self, migration_id: str) -> None:
        self.store.drop(migration_id)

    def close(self) -> None:
        self._stop.set()
        self.receiver.close()
