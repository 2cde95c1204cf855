"""The instance's live load: engine snapshots (or the /metrics fallback) joined with the llumlet's
own request book, turned into virtual usage and freeness by the shared load model."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass

from llumlet.engine_metrics import EngineMetrics
from llumlet.prefix_cache import PrefixCacheMirror
from llumlet.requests import RequestRecord, RequestTable
from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    InstanceLoad,
    LoadModelConfig,
    RequestLoad,
    blocks_for_tokens,
    freeness,
    virtual_usage,
)
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot
from llumnix.wire import LoadReport, LoadSource


@dataclass(frozen=True, slots=True)
class SnapshotHealth:
    stalled: bool
    """Snapshots stopped while the engine has work (the load comes from /metrics)."""
    age_s: float
    """Seconds since the newest snapshot arrived (inf before the first)."""


class LoadTracker:
    """Holds the newest engine observation and computes `LoadReport`s; wakes `wait_for_change`
    callers whenever a new observation or a local change (admission, draining) arrives."""

    def __init__(
        self,
        instance_id: str,
        requests: RequestTable,
        snapshot_timeout_s: float = 2.0,
        config: LoadModelConfig = DEFAULT_LOAD_MODEL,
    ) -> None:
        self.instance_id = instance_id
        self.requests = requests
        self.snapshot_timeout_s = snapshot_timeout_s
        self.config = config
        self._draining = False
        self._snapshot: EngineSnapshot | None = None
        self._snapshot_received = -math.inf
        self._snapshot_preemptions = 0
        self._metrics: EngineMetrics | None = None
        self._metrics_time = 0.0
        self._metrics_preemptions = 0
        self._sequence = 0
        self._version = 0
        self._changed = asyncio.Event()
        # Migrations (llumlet/migration): requests moving out, and reservations for requests moving in.
        self.migrating_out: set[str] = set()
        self.migrating_in = 0
        self.reserved_blocks = 0
        self.prefix_cache = PrefixCacheMirror()
        """What the engine has in its prefix cache, from the snapshots."""

    # --- inputs
    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self.notify()

    def on_snapshot(self, snapshot: EngineSnapshot, received_at: float | None = None) -> None:
        previous = self._snapshot
        same_engine = previous is not None and previous.engine_id == snapshot.engine_id
        if same_engine and snapshot.step <= previous.step:
            return
        base = previous.preemptions_total if same_engine else snapshot.preemptions_total
        self._snapshot_preemptions = max(0, snapshot.preemptions_total - base)
        if previous is not None and not same_engine:
            self.prefix_cache.engine_restarted()
        if snapshot.HasField("prefix_cache"):
            self.prefix_cache.apply(snapshot.prefix_cache)
        self._snapshot = snapshot
        self._snapshot_received = time.time() if received_at is None else received_at
        self.notify()

    def engine_runs(self, request_id: str, since: float) -> bool:
        """Whether a snapshot the engine took after `since` (seconds since the epoch) lists the request
        as running there."""
        snapshot = self._snapshot
        return (snapshot is not None and snapshot.timestamp > since
                and any(request.request_id == request_id for request in snapshot.running))

    def on_metrics(self, metrics: EngineMetrics, observed_at: float | None = None) -> None:
        previous = self._metrics
        self._metrics_preemptions = max(0, metrics.preemptions_total - previous.preemptions_total) \
            if previous else 0
        self._metrics = metrics
        self._metrics_time = time.time() if observed_at is None else observed_at
        if self.snapshot_health().stalled:
            self.notify()

    @property
    def version(self) -> int:
        """Counts changes; pass it to `wait_for_change` to wait for the next one."""
        return self._version

    def notify(self) -> None:
        self._version += 1
        # Every waiter holds the event it waits on; a fresh one for the next change means no
        # waiter can clear a change another has not seen yet.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_for_change(self, seen_version: int, timeout_s: float) -> int:
        """Returns the version once it differs from `seen_version`, or after `timeout_s`."""
        if self._version == seen_version:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self._version

    # --- state
    def snapshot_health(self, now: float | None = None) -> SnapshotHealth:
        now = time.time() if now is None else now
        age = now - self._snapshot_received
        if age <= self.snapshot_timeout_s:
            return SnapshotHealth(False, age)
        # No engine step publishes while the engine is idle, so an old snapshot is only stale when
        # work has been waiting for the engine for longer than the timeout.
        oldest_admission = min((r.admitted_at for r in self.requests), default=math.inf)
        llumlet_busy = now - max(oldest_admission, self._snapshot_received) > self.snapshot_timeout_s
        engine_busy = self._metrics is not None and self._metrics_time > self._snapshot_received + \
            self.snapshot_timeout_s and (self._metrics.running + self._metrics.waiting) > 0
        stalled = self._snapshot is None or llumlet_busy or engine_busy
        return SnapshotHealth(stalled and (self._snapshot is not None or self._metrics is not None), age)

    def report(self, now: float | None = None) -> LoadReport | None:
        """The current load; None until the engine was observed at least once."""
        now = time.time() if now is None else now
        health = self.snapshot_health(now)
        if self._snapshot is not None and not health.stalled:
            load, source = self._load_from_snapshot(self._snapshot), LoadSource.CONNECTOR
        elif self._metrics is not None:
            load, source = self._load_from_metrics(self._metrics), LoadSource.METRICS_FALLBACK
        elif self._snapshot is not None:
            load, source = self._load_from_snapshot(self._snapshot), LoadSource.CONNECTOR
        else:
            return None
        self._sequence += 1
        observed = load.timestamp
        return LoadReport(
            load=load,
            freeness=freeness(load, self.config),
            virtual_usage=virtual_usage(load, self.config),
            snapshot_age_s=max(0.0, now - observed),
            source=source,
            sequence=self._sequence,
        )

    def _load_from_snapshot(self, snapshot: EngineSnapshot) -> InstanceLoad:
        high = self.requests.high_priority_ids()
        moving = self.migrating_out
        seen = {r.request_id for r in snapshot.running} | {r.request_id for r in snapshot.waiting}
        # Admitted but not yet in the engine's queue (in transit, tokenizing): they will be.
        pending = tuple(_pending_load(r) for r in self.requests
                        if not r.started and r.request_id not in seen)
        return InstanceLoad(
            instance_id=self.instance_id,
            total_blocks=snapshot.total_blocks,
            free_blocks=snapshot.free_blocks,
            block_size=snapshot.block_size,
            running=tuple(_engine_request_load(r, high, moving) for r in snapshot.running),
            waiting=tuple(_engine_request_load(r, high, moving) for r in snapshot.waiting) + pending,
            draining=self._draining,
            preemptions=self._snapshot_preemptions,
            timestamp=snapshot.timestamp,
            migrating_out=len(self.migrating_out),
            migrating_in=self.migrating_in,
            reserved_blocks=self.reserved_blocks,
        )

    def _load_from_metrics(self, metrics: EngineMetrics) -> InstanceLoad:
        """Aggregates only: the llumlet's own requests stand in for the engine's, started ones as
        running (holding the blocks their tokens need), the others as waiting."""
        records = list(self.requests)
        started = [r for r in records if r.started]
        queued = [r for r in records if not r.started]
        running = tuple(
            RequestLoad(r.request_id, r.prompt_tokens, r.output_tokens,
                        blocks_for_tokens(r.prompt_tokens + r.output_tokens, metrics.block_size),
                        r.high_priority, r.admitted_at, r.request_id in self.migrating_out)
            for r in started
        )
        return InstanceLoad(
            instance_id=self.instance_id,
            total_blocks=metrics.total_blocks,
            free_blocks=metrics.free_blocks,
            block_size=metrics.block_size,
            running=running,
            waiting=tuple(_pending_load(r) for r in queued),
            draining=self._draining,
            preemptions=self._metrics_preemptions,
            timestamp=self._metrics_time,
            migrating_out=len(self.migrating_out),
            migrating_in=self.migrating_in,
            reserved_blocks=self.reserved_blocks,
        )


def _engine_request_load(request: EngineRequest, high_priority_ids: frozenset[str],
                         migrating_ids: set[str]) -> RequestLoad:
    return RequestLoad(
        request_id=request.request_id,
        prompt_tokens=request.prompt_tokens,
        output_tokens=request.output_tokens,
        blocks=request.blocks,
        high_priority=request.high_priority or request.request_id in high_priority_ids,
        arrival_time=request.arrival_time,
        migrating=request.request_id in migrating_ids,
    )


def _pending_load(record: RequestRecord) -> RequestLoad:
    return RequestLoad(record.request_id, record.prompt_tokens, 0, 0, record.high_priority,
                       record.admitted_at)


def load_key(report: LoadReport) -> tuple[object, ...]:
    """What makes two reports different to a subscriber (not their age or sequence number)."""
    load = report.load
    return (load.total_blocks, load.free_blocks, load.running, load.waiting, load.draining,
            load.preemptions, load.reserved_blocks, load.migrating_in, load.migrating_out, report.source)
