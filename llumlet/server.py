"""The llumlet process: wires the engine client, the load tracker, the admission path and the
HTTP and gRPC servers, and shuts down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from llumlet.admission import Admission
from llumlet.auth import TokenInterceptor
from llumlet.engine_client import EngineClient
from llumlet.engine_monitor import read_snapshots, watch_engine
from llumlet.grpc_service import LlumletService
from llumlet.health import HealthReporter
from llumlet.http_front import HttpFront
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.coordinator import MigrationCoordinator
from llumlet.migration.service import MigrationService
from llumlet.migration.settings import MigrationSettings
from llumlet.requests import RequestTable
from llumnix.engine.snapshots import SnapshotSubscriber
from llumnix.load import LoadModelConfig
from llumnix.service_token import ServiceToken
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1.kv_transfer_pb2 import MigrationEvent

logger = logging.getLogger("llumlet")


@dataclass(frozen=True, slots=True)
class LlumletConfig:
    instance_id: str
    engine_url: str
    snapshot_addr: str
    host: str = "0.0.0.0"
    http_port: int = 8100
    grpc_port: int = 50051
    snapshot_timeout_s: float = 2.0
    engine_check_interval_s: float = 0.5
    shutdown_grace_s: float = 30.0
    engine_priority_scheduling: bool = False
    high_priority_target_tokens: int = LoadModelConfig().high_priority_target_tokens
    migration: MigrationSettings = field(default_factory=MigrationSettings)
    service_token: ServiceToken | None = None
    """Required of every caller (gRPC, and HTTP but /health and /metrics); None: nobody is asked."""


class Llumlet:
    def __init__(self, config: LlumletConfig) -> None:
        self.config = config
        self.requests = RequestTable()
        self.tracker = LoadTracker(config.instance_id, self.requests, config.snapshot_timeout_s,
                                   LoadModelConfig(config.high_priority_target_tokens))
        self.metrics = LlumletMetrics(config.instance_id, self.tracker.report, self._engine_staging)
        self.engine = EngineClient(config.engine_url)
        self.admission = Admission(self.engine, self.requests, self.tracker, self.metrics,
                                   config.engine_priority_scheduling)
        self.health = HealthReporter(self.admission, self.tracker)
        self.migration: MigrationCoordinator | None = None
        self._subscriber: SnapshotSubscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self.http_port = config.http_port
        self.grpc_port = config.grpc_port

    def _engine_staging(self) -> MigrationEvent | None:
        """The engine's newest report of its migration staging (for /metrics)."""
        return self.migration.link.staging_held() if self.migration is not None else None

    async def start(self) -> None:
        self._subscriber = SnapshotSubscriber(self.config.snapshot_addr)
        self._tasks = [
            asyncio.create_task(read_snapshots(self._subscriber, self.tracker), name="snapshots"),
            asyncio.create_task(watch_engine(self.admission, self.tracker,
                                             self.config.engine_check_interval_s), name="engine-watch"),
        ]
        token = self.config.service_token
        self._grpc = grpc.aio.server(interceptors=[TokenInterceptor(token)] if token is not None else None)
        grpc_address = f"{self.config.host}:{self.config.grpc_port}"
        try:
            self.grpc_port = self._grpc.add_insecure_port(grpc_address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {grpc_address} (gRPC): {exc}") from None
        self.migration = MigrationCoordinator(
            self.config.instance_id, f"{self.config.host}:{self.grpc_port}", self.config.snapshot_addr,
            self.admission, self.tracker, self.metrics, self.config.migration, token)
        self.migration.start()
        llumlet_pb2_grpc.add_LlumletServicer_to_server(
            LlumletService(self.admission, self.tracker, self.health, self.migration.destination), self._grpc)
        migration_pb2_grpc.add_LlumletMigrationServicer_to_server(
            MigrationService(self.migration.source, self.migration.destination), self._grpc)
        await self._grpc.start()
        # handler_cancellation: a client that goes away cancels its handler, which aborts the request
        # on the engine (without it a non-streaming request runs to the end for nobody).
        self._http = web.AppRunner(HttpFront(self.admission, self.health, self.metrics, token).app(),
                                   access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._http.setup()
        site = web.TCPSite(self._http, self.config.host, self.config.http_port)
        try:
            await site.start()
        except OSError as exc:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.http_port} (HTTP): "
                          f"{exc.strerror or exc}") from None
        self.http_port = self._http.addresses[0][1]
        logger.info("llumlet started", extra={"http_port": self.http_port, "grpc_port": self.grpc_port,
                                              "engine": self.config.engine_url,
                                              "snapshots": self.config.snapshot_addr,
                                              "authenticated": token is not None})

    async def shutdown(self) -> None:
        """Stops admitting (new requests get 503 and the load reports infinite usage), lets in-flight
        requests finish within the grace period, fails the rest, then stops the servers."""
        self.admission.shutting_down = True
        self.tracker.draining = True
        in_flight = len(self.requests)
        logger.info("shutting down", extra={"in_flight": in_flight, "grace_s": self.config.shutdown_grace_s})
        if not await self.admission.wait_idle(self.config.shutdown_grace_s):
            failed = self.admission.fail_all(503, "the llumlet shut down before the request finished",
                                             "ServiceUnavailableError")
            logger.warning("grace period expired", extra={"failed_requests": failed})
            await self.admission.wait_idle(2.0)
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._http is not None:
            await self._http.cleanup()
        if self.migration is not None:
            await self.migration.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._subscriber is not None:
            self._subscriber.close()
        await self.engine.close()
        logger.info("llumlet stopped")

    async def serve_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
        except OSError:
            await self.shutdown()
            raise
        await stop.wait()
        # One SIGTERM starts the graceful shutdown; another one (a supervisor repeating itself) must not
        # kill the process halfway, including after the event loop has closed and its handlers are gone.
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await self.shutdown()
