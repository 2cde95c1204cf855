"""The one admission path shared by the HTTP front and gRPC `Generate`: refuse when the instance
cannot take work, book the request, tag it for the connector, stream it from the engine and record
its tokens as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llumlet.engine_client import EngineClient, EngineError, EngineUnavailableError
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.requests import DuplicateRequestError, RequestRecord, RequestTable
from llumnix.openai_request import OpenAIRequestError, check_generation_body
from llumnix.openai_stream import EndpointKind, GenerationChunk, openai_error, parse_stream_chunk

logger = logging.getLogger("llumlet.admission")

ENGINE_HIGH_PRIORITY = -1
"""vLLM's priority scheduler serves lower values first; normal requests keep its default 0."""


class AdmissionError(Exception):
    """A request the llumlet refuses or could not complete; `body` is the OpenAI error JSON."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(str(body["error"]["message"]))

    @classmethod
    def of(cls, status: int, message: str, err_type: str | None = None,
           param: str | None = None) -> AdmissionError:
        return cls(status, openai_error(status, message, err_type, param))


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One engine stream event: the engine's JSON as sent, and its chunks."""

    payload: dict[str, Any]
    chunks: list[GenerationChunk]


@dataclass(slots=True)
class _InFlight:
    response: aiohttp.ClientResponse | None = None
    aborted: bool = False
    failure: AdmissionError | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def interrupt(self) -> None:
        if self.response is not None:
            self.response.close()


def validate_body(endpoint: EndpointKind, body: Any) -> dict[str, Any]:
    """Checks that the llumlet itself needs; the engine validates the rest (its 4xx pass through)."""
    try:
        body = check_generation_body(endpoint, body)
    except OpenAIRequestError as exc:
        raise AdmissionError(exc.status, exc.body) from None
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise AdmissionError.of(400, "'kv_transfer_params' must be an object", param="kv_transfer_params")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise AdmissionError.of(400, "'stream_options' must be an object", param="stream_options")
    return body


class Admission:
    def __init__(
        self,
        engine: EngineClient,
        requests: RequestTable,
        tracker: LoadTracker,
        metrics: LlumletMetrics,
        engine_priority_scheduling: bool = False,
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.tracker = tracker
        self.metrics = metrics
        self.engine_priority_scheduling = engine_priority_scheduling
        self.shutting_down = False
        self.engine_healthy = False
        """Set by the engine watcher; unknown (False) until its first check."""
        self._in_flight: dict[str, _InFlight] = {}

    def refusal(self) -> AdmissionError | None:
        if self.shutting_down:
            return AdmissionError.of(503, "this llumlet is shutting down; send the request elsewhere",
                                     "ServiceUnavailableError")
        if self.tracker.draining:
            return AdmissionError.of(503, "this instance is draining; send the request elsewhere",
                                     "ServiceUnavailableError")
        if not self.engine_healthy:
            return AdmissionError.of(503, "the engine behind this llumlet is not healthy",
                                     "EngineUnavailable")
        return None

    def engine_body(self, record: RequestRecord) -> dict[str, Any]:
        body = dict(record.body)
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        body["return_token_ids"] = True
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                      "llumlet_id": record.request_id}
        if self.engine_priority_scheduling and record.high_priority:
            body["priority"] = ENGINE_HIGH_PRIORITY
        return body

    async def generate(self, endpoint: EndpointKind, body: Any, request_id: str,
                       high_priority: bool = False) -> AsyncGenerator[StreamEvent, None]:
        """Streams the request's events. Raises `AdmissionError` before the first event when the
        request is refused, and at any point when it fails; an aborted request ends with a chunk
        whose finish reason is "abort" for every unfinished choice."""
        refusal = self.refusal()
        if refusal is not None:
            self.metrics.refused.inc()
            raise refusal
        record = RequestRecord(request_id, endpoint, validate_body(endpoint, body), high_priority)
        try:
            self.requests.add(record)
        except DuplicateRequestError as exc:
            raise AdmissionError.of(409, str(exc), "ConflictError") from None
        in_flight = self._in_flight[request_id] = _InFlight()
        self.metrics.admitted.inc()
        self.tracker.notify()
        outcome = "failed"
        try:
            async with contextlib.aclosing(self._stream(record, in_flight)) as events:
                async for event in events:
                    yield event
            outcome = "aborted" if in_flight.aborted else "finished"
        except GeneratorExit:
            outcome = "client-gone"  # the caller stopped reading; closing the stream aborts it
            raise
        finally:
            in_flight.closed.set()
            self._in_flight.pop(request_id, None)
            self.requests.remove(request_id)
            self.metrics.finished.labels(outcome).inc()
            self.tracker.notify()

    async def _stream(self, record: RequestRecord, in_flight: _InFlight
                      ) -> AsyncGenerator[StreamEvent, None]:
        try:
            in_flight.response = await self.engine.open_stream(record.endpoint, self.engine_body(record))
            if in_flight.aborted or in_flight.failure is not None:
                in_flight.interrupt()
            async for payload in self.engine.iter_events(in_flight.response):
                if not record.started:
                    self.metrics.engine_ttft.observe(time.time() - record.admitted_at)
                chunks = parse_stream_chunk(record.endpoint, payload)
                for chunk in chunks:
                    record.observe(chunk)
                yield StreamEvent(payload, chunks)
        except EngineError as exc:
            if in_flight.aborted:
                yield _abort_event(record)
                return
            if in_flight.failure is not None:
                raise in_flight.failure from None
            if isinstance(exc, EngineUnavailableError):
                logger.warning("request failed: engine unavailable",
                               extra={"request_id": record.request_id, "reason": str(exc)})
            raise AdmissionError(exc.status, exc.body) from None
        finally:
            if in_flight.response is not None:
                in_flight.response.close()

    def abort(self, request_id: str) -> bool:
        in_flight = self._in_flight.get(request_id)
        if in_flight is None:
            return False
        in_flight.aborted = True
        in_flight.interrupt()
        return True

    def fail_all(self, status: int, message: str, err_type: str) -> int:
        """Ends every in-flight request with this error (engine died, shutdown grace expired)."""
        for in_flight in self._in_flight.values():
            in_flight.failure = AdmissionError.of(status, message, err_type)
            in_flight.interrupt()
        return len(self._in_flight)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight; False when the timeout expired first."""
        async def drained() -> None:
            while self._in_flight:
                await next(iter(self._in_flight.values())).closed.wait()

        try:
            await asyncio.wait_for(drained(), timeout_s)
        except TimeoutError:
            return False
        return True


def _abort_event(record: RequestRecord) -> StreamEvent:
    """The closing chunk of an aborted request, in the engine's stream format and as chunks."""
    indexes = [i for i in sorted(record.generated_token_ids) or [0] if i not in record.finish_reasons]
    chat = record.endpoint is EndpointKind.CHAT
    payload = {
        "id": record.request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": str(record.body.get("model") or ""),
        "choices": [{"index": i, **({"delta": {}} if chat else {"text": ""}), "finish_reason": "abort"}
                    for i in indexes],
    }
    return StreamEvent(payload, [GenerationChunk(index=i, finish_reason="abort") for i in indexes])
