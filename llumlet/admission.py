"""The one admission path shared by the HTTP front and gRPC `Generate`: refuse when the instance
cannot take work, book the request, tag it for the connector, stream it from the engine and record
its tokens as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from llumlet.engine_client import EngineClient, EngineError, EngineUnavailableError
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.requests import DuplicateRequestError, RequestRecord, RequestTable, ResumePoint
from llumnix.openai_request import OpenAIRequestError, PromptSizer, check_generation_body
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage, openai_error, parse_stream_chunk

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
class MovedTo:
    """Where a migrated request continues (the stream's last event on the source)."""

    instance_id: str
    address: str
    request_id: str
    migration_id: str


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One engine stream event: the engine's JSON as sent, and its chunks; or the request's move."""

    payload: dict[str, Any]
    chunks: list[GenerationChunk]
    moved: MovedTo | None = None


class Suspension:
    """A migration's final stage stops the request's engine stream; its coordinator then decides
    whether the stream ends with a move or continues here from a resume point (recompute)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped: asyncio.Future[bool] = loop.create_future()
        """True once the stream stopped at the suspension, False if the request finished first."""
        self._decision: asyncio.Future[MovedTo | ResumePoint] = loop.create_future()

    def decide(self, decision: MovedTo | ResumePoint) -> None:
        if not self._decision.done():
            self._decision.set_result(decision)

    async def decision(self) -> MovedTo | ResumePoint:
        return await self._decision

    def mark_stopped(self, stopped: bool) -> None:
        if not self.stopped.done():
            self.stopped.set_result(stopped)


@dataclass(slots=True)
class _InFlight:
    response: aiohttp.ClientResponse | None = None
    aborted: bool = False
    failure: AdmissionError | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    suspension: Suspension | None = None

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
        self.prompt_sizer = PromptSizer()
        """Learns the engine's text size of a token from the prompt lengths it reports."""
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
        body = dict(record.resume.body if record.resume is not None else record.body)
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        body["return_token_ids"] = True
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                      "llumlet_id": record.request_id}
        if self.engine_priority_scheduling and record.high_priority:
            body["priority"] = ENGINE_HIGH_PRIORITY
        return body

    async def generate(self, endpoint: EndpointKind, body: Any, request_id: str,
                       high_priority: bool = False, migratable: bool = False
                       ) -> AsyncGenerator[StreamEvent, None]:
        """Streams the request's events. Raises `AdmissionError` before the first event when the
        request is refused, and at any point when it fails; an aborted request ends with a chunk
        whose finish reason is "abort" for every unfinished choice; a `migratable` request that
        moved ends with an event naming where it continues."""
        refusal = self.refusal()
        if refusal is not None:
            self.metrics.refused.inc()
            raise refusal
        record = RequestRecord(request_id, endpoint, validate_body(endpoint, body), high_priority,
                               migratable=migratable, bytes_per_token=self.prompt_sizer.bytes_per_token)
        async with contextlib.aclosing(self.run(record)) as events:
            async for event in events:
                yield event

    async def run(self, record: RequestRecord) -> AsyncGenerator[StreamEvent, None]:
        """Books an already validated request (a new one, or one migrated in) and streams it."""
        request_id = record.request_id
        try:
            self.requests.add(record)
        except DuplicateRequestError as exc:
            raise AdmissionError.of(409, str(exc), "ConflictError") from None
        in_flight = self._in_flight[request_id] = _InFlight()
        self.metrics.admitted.inc()
        self.tracker.notify()
        outcome = "failed"
        moved = False
        try:
            async with contextlib.aclosing(self._stream(record, in_flight)) as events:
                async for event in events:
                    moved = event.moved is not None
                    yield event
            outcome = "aborted" if in_flight.aborted else "moved" if moved else "finished"
        except GeneratorExit:
            outcome = "client-gone"  # the caller stopped reading; closing the stream aborts it
            raise
        finally:
            in_flight.closed.set()
            if in_flight.suspension is not None:
                in_flight.suspension.mark_stopped(False)
            self._in_flight.pop(request_id, None)
            self.requests.remove(request_id)
            self.metrics.finished.labels(outcome).inc()
            self.tracker.notify()

    async def _stream(self, record: RequestRecord, in_flight: _InFlight
                      ) -> AsyncGenerator[StreamEvent, None]:
        while True:
            try:
                async with contextlib.aclosing(self._engine_stream(record, in_flight)) as events:
                    async for event in events:
                        yield event
                return
            except EngineError as exc:
                suspension = in_flight.suspension
                if suspension is not None and not in_flight.aborted and in_flight.failure is None:
                    # The llumlet cut the stream for a migration's final stage.
                    suspension.mark_stopped(True)
                    decision = await suspension.decision()
                    in_flight.suspension = None
                    if isinstance(decision, MovedTo):
                        yield StreamEvent({}, [], moved=decision)
                        return
                    record.resume = decision
                    continue
                if in_flight.aborted:
                    yield _abort_event(record)
                    return
                if in_flight.failure is not None:
                    raise in_flight.failure from None
                if isinstance(exc, EngineUnavailableError):
                    logger.warning("request failed: engine unavailable",
                                   extra={"request_id": record.request_id, "reason": str(exc)})
                raise AdmissionError(exc.status, exc.body) from None

    async def _engine_stream(self, record: RequestRecord, in_flight: _InFlight
                             ) -> AsyncGenerator[StreamEvent, None]:
        resume = record.resume
        try:
            in_flight.response = await self.engine.open_stream(record.engine_endpoint,
                                                               self.engine_body(record))
            if in_flight.aborted or in_flight.failure is not None or in_flight.suspension is not None:
                in_flight.interrupt()
            async for payload in self.engine.iter_events(in_flight.response):
                if not record.started:
                    self.metrics.engine_ttft.observe(time.time() - record.admitted_at)
                chunks = parse_stream_chunk(record.engine_endpoint, payload)
                if resume is not None:
                    chunks = [_continued(chunk, record, resume) for chunk in chunks]
                prompt_known = bool(record.prompt_token_ids)
                for chunk in chunks:
                    record.observe(chunk)
                if not prompt_known and record.prompt_token_ids and resume is None:
                    self.prompt_sizer.learn(record.endpoint, record.body, len(record.prompt_token_ids))
                yield StreamEvent(payload, chunks)
        finally:
            if in_flight.response is not None:
                in_flight.response.close()

    def suspend(self, request_id: str) -> Suspension | None:
        """Stops the request's engine stream (vLLM aborts on disconnect) and holds its caller's stream
        until the suspension is decided; None when the request is not running here."""
        in_flight = self._in_flight.get(request_id)
        if in_flight is None or in_flight.aborted or in_flight.suspension is not None:
            return None
        in_flight.suspension = Suspension()
        in_flight.interrupt()
        return in_flight.suspension

    def running(self, request_id: str) -> bool:
        return request_id in self._in_flight

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


def _continued(chunk: GenerationChunk, record: RequestRecord, resume: ResumePoint) -> GenerationChunk:
    """A resumed stream's chunk as part of the original request: the caller has the prompt already,
    and usage counts the original prompt and every generated token."""
    usage = chunk.usage
    if usage is not None:
        usage = Usage(len(record.prompt_token_ids), usage.completion_tokens + resume.generated_before)
    return replace(chunk, prompt_token_ids=(), usage=usage)


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
