"""The llumlet's gRPC service (proto/llumnix/v1/llumlet.proto)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc
import orjson

from llumlet.admission import Admission, AdmissionError, StreamEvent
from llumlet.health import HealthReporter, HealthStatus
from llumlet.load_tracker import LoadTracker, load_key
from llumlet.migration.destination import Destination
from llumlet.serve_stream import ServeStream
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc
from llumnix.wire import LoadSource, chunk_to_proto, endpoint_from_proto, report_to_proto, source_to_proto

logger = logging.getLogger("llumlet.grpc")

DEFAULT_MIN_INTERVAL_MS = 50
DEFAULT_MAX_INTERVAL_MS = 1000
MIN_ALLOWED_INTERVAL_MS = 5

_HEALTH_TO_PB = {HealthStatus.SERVING: pb.HEALTH_STATUS_SERVING,
                 HealthStatus.DEGRADED: pb.HEALTH_STATUS_DEGRADED,
                 HealthStatus.NOT_SERVING: pb.HEALTH_STATUS_NOT_SERVING}


def grpc_code_for(status: int) -> grpc.StatusCode:
    """The gRPC status for an OpenAI/HTTP error status."""
    if status == 409:
        return grpc.StatusCode.ALREADY_EXISTS
    if status == 404:
        return grpc.StatusCode.NOT_FOUND
    if status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if 400 <= status < 500:
        return grpc.StatusCode.INVALID_ARGUMENT
    if status in (502, 503, 504):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class LlumletService(llumlet_pb2_grpc.LlumletServicer):
    def __init__(self, admission: Admission, tracker: LoadTracker, health: HealthReporter,
                 destination: Destination) -> None:
        self.admission = admission
        self.tracker = tracker
        self.health = health
        self.destination = destination

    def _current_load(self) -> pb.InstanceLoad:
        report = self.tracker.report()
        if report is None:
            return pb.InstanceLoad(instance_id=self.tracker.instance_id, freeness=-math.inf,
                                   virtual_usage=math.inf, snapshot_age_s=math.inf,
                                   source=source_to_proto(LoadSource.METRICS_FALLBACK),
                                   draining=self.tracker.draining, timestamp=time.time())
        return report_to_proto(report)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
                      ) -> pb.InstanceLoad:
        return self._current_load()

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.InstanceLoad]:
        min_interval = max(MIN_ALLOWED_INTERVAL_MS, request.min_interval_ms or DEFAULT_MIN_INTERVAL_MS) / 1e3
        max_interval = max(min_interval, (request.max_interval_ms or DEFAULT_MAX_INTERVAL_MS) / 1e3)
        last_key: tuple[object, ...] | None = None
        last_sent = -math.inf
        cache_cursor: int | None = None  # the prefix-cache changes this stream has been sent
        while True:
            seen = self.tracker.version
            report = self.tracker.report()
            now = time.monotonic()
            key = (load_key(report), self.tracker.prefix_cache.version) if report is not None else None
            if key != last_key or now - last_sent >= max_interval:
                message = report_to_proto(report) if report is not None else self._current_load()
                cache_cursor = self.tracker.prefix_cache.fill(message, cache_cursor)
                yield message
                last_key, last_sent = key, now
            # Wait for a change (bounded by the heartbeat), then keep the minimum spacing.
            remaining = max(0.0, max_interval - (time.monotonic() - last_sent))
            await self.tracker.wait_for_change(seen, remaining)
            spacing = min_interval - (time.monotonic() - last_sent)
            if spacing > 0:
                await asyncio.sleep(spacing)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async with contextlib.aclosing(self.request_events(request)) as events:
                async for event in events:
                    for response in _responses(event):
                        yield response
        except AdmissionError as exc:
            await context.abort(grpc_code_for(exc.status), json.dumps(exc.body))

    async def Serve(self, request_iterator: AsyncIterator[pb.ServeCommand],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServeEvents]:
        stream = ServeStream(self.request_events)
        reader = asyncio.create_task(stream.read_commands(request_iterator), name="serve-commands")
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            reader.cancel()
            await stream.close()

    async def request_events(self, request: pb.GenerateRequest) -> AsyncIterator[StreamEvent]:
        """A request's events, from admission (or from its first token here after it migrated in);
        raises `AdmissionError` when it is refused or fails."""
        if not request.request_id:
            raise AdmissionError.of(400, "request_id is required")
        if request.attach:
            stream = self.destination.attach(request.request_id)
            if stream is None:
                raise AdmissionError.of(404, f"no migrated request {request.request_id!r} waits here",
                                        "NotFoundError")
            try:
                async for event in stream.events():
                    yield event
            finally:
                self.destination.detach(stream)
            return
        try:
            endpoint = endpoint_from_proto(request.endpoint)
            body = orjson.loads(request.body_json)
        except ValueError as exc:
            raise AdmissionError.of(400, str(exc)) from None
        events = self.admission.generate(endpoint, body, request.request_id,
                                         request.priority == pb.PRIORITY_HIGH, migratable=True)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.admission.abort(request.request_id))

    async def SetDraining(self, request: pb.SetDrainingRequest, context: grpc.aio.ServicerContext
                          ) -> pb.SetDrainingResponse:
        if request.draining != self.tracker.draining:
            logger.info("draining changed", extra={"draining": request.draining})
        self.tracker.draining = request.draining
        return pb.SetDrainingResponse(draining=self.tracker.draining, in_flight=len(self.tracker.requests))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
                     ) -> pb.HealthResponse:
        report = self.health.report()
        return pb.HealthResponse(
            status=_HEALTH_TO_PB[report.status],
            instance_id=report.instance_id,
            engine_healthy=report.engine_healthy,
            draining=report.draining,
            load_source=source_to_proto(LoadSource.METRICS_FALLBACK if report.snapshots_stalled
                                        else LoadSource.CONNECTOR),
            snapshot_age_s=report.snapshot_age_s,
            in_flight=report.in_flight,
            message=report.message,
        )


def _responses(event: StreamEvent) -> list[pb.GenerateResponse]:
    if event.moved is not None:
        moved = event.moved
        return [pb.GenerateResponse(moved=pb.Moved(instance_id=moved.instance_id, address=moved.address,
                                                   request_id=moved.request_id,
                                                   migration_id=moved.migration_id))]
    return [pb.GenerateResponse(chunk=chunk_to_proto(chunk)) for chunk in event.chunks]
