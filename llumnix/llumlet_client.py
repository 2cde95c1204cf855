"""A connection to one llumlet as its callers (the router, the control loop) hold it: a gRPC channel,
a `WatchLoad` subscription that keeps the latest load (reconnecting with backoff), and the control
calls the control loop sends (SetDraining, MigrateOut)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from llumnix.service_token import ServiceToken, call_metadata
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2, migration_pb2_grpc
from llumnix.wire import LoadReport, report_from_proto

logger = logging.getLogger("llumnix.llumlet_client")

WATCH_MIN_INTERVAL_MS = 20
WATCH_MAX_INTERVAL_MS = 1000
STALE_AFTER_S = 3.0
"""No load (not even the 1 s heartbeat) for this long: the stream is down."""
RECONNECT_BACKOFF_S = (0.1, 2.0)
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000))
"""gRPC's own reconnect backoff grows to 120 s while a llumlet is down, and every channel to the address
shares it (one global subchannel pool): a llumlet restarted at the same address went unseen for
seconds to minutes (bench/grpc_reconnect.py: 10.0 s after a 30 s outage, 13.8 s on a new channel; 1.1 s
with these)."""
CONTROL_TIMEOUT_S = 5.0
MIGRATE_OUT_TIMEOUT_S = 120.0
"""A migration answers when it ended; a long request's stages take a while."""


def llumlet_channel(address: str) -> grpc.aio.Channel:
    """A channel to a llumlet that reconnects within `RECONNECT_BACKOFF_S` of its return."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class LlumletConnection:
    """One llumlet: channel, stubs and the latest load from its `WatchLoad` stream. `on_change` runs
    after every accepted load and whenever the stream goes down. Every call presents `token` (the
    service's; `call_metadata` for the calls others make on this channel)."""

    def __init__(self, address: str, on_change: Callable[[], None] = lambda: None, *,
                 token: ServiceToken | None = None) -> None:
        self.address = address
        self.call_metadata = call_metadata(token)
        self.channel = llumlet_channel(address)
        self.stub = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.migration_stub = migration_pb2_grpc.LlumletMigrationStub(self.channel)
        self.report: LoadReport | None = None
        self.last_seen = -float("inf")
        self.removed = False
        """Set on close: the watch loop ends."""
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self.report.load.instance_id if self.report else self.address

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"watch-load {self.address}")

    async def close(self) -> None:
        self.removed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.channel.close(grace=None)

    def connected(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.report is not None and now - self.last_seen < STALE_AFTER_S

    def observe(self, report: LoadReport) -> None:
        if self.report is not None and report.sequence <= self.report.sequence \
                and report.load.timestamp <= self.report.load.timestamp:
            return  # reordered or repeated (a restarted llumlet restarts its sequence, with newer time)
        self.report = report
        self.last_seen = time.monotonic()
        self._observed(report)
        self._on_change()

    def _observed(self, report: LoadReport) -> None:
        """Hook for subclasses: runs after a load was accepted, before `on_change`."""

    async def set_draining(self, draining: bool) -> pb.SetDrainingResponse:
        request = pb.SetDrainingRequest(draining=draining)
        return await self.stub.SetDraining(request, timeout=CONTROL_TIMEOUT_S, metadata=self.call_metadata)

    async def migrate_out(self, request: migration_pb2.MigrateOutRequest) -> migration_pb2.MigrateOutResponse:
        return await self.migration_stub.MigrateOut(request, timeout=MIGRATE_OUT_TIMEOUT_S,
                                                    metadata=self.call_metadata)

    async def _watch(self) -> None:
        backoff = RECONNECT_BACKOFF_S[0]
        request = pb.WatchLoadRequest(min_interval_ms=WATCH_MIN_INTERVAL_MS,
                                      max_interval_ms=WATCH_MAX_INTERVAL_MS)
        while not self.removed:
            try:
                async for message in self.stub.WatchLoad(request, metadata=self.call_metadata):
                    first = self.report is None or not self.connected()
                    self.observe(report_from_proto(message))
                    if first:
                        logger.info("instance load stream up",
                                    extra={"address": self.address, "instance_id": self.instance_id})
                    backoff = RECONNECT_BACKOFF_S[0]
            except grpc.aio.AioRpcError as exc:
                if self.connected():
                    logger.warning("instance load stream down", extra={
                        "address": self.address, "instance_id": self.instance_id, "code": exc.code().name})
            except ValueError as exc:  # a load this client cannot read (a newer llumlet's enum value)
                logger.warning("unreadable load; resubscribing", extra={"address": self.address,
                                                                       "reason": str(exc)})
            self.last_seen = -float("inf")
            self._on_change()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])
