"""The llumlet's HTTP server: the engine's OpenAI API in front of the engine (every request goes
through the shared admission path), plus the llumlet's own /health and /metrics."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from llumlet.admission import Admission, AdmissionError, StreamEvent
from llumlet.auth import http_middleware
from llumlet.engine_client import EngineUnavailableError
from llumlet.health import HealthReporter
from llumlet.metrics import LlumletMetrics
from llumnix.openai_request import (
    OpenAIRequestError,
    add_openai_routes,
    read_json_body,
    read_stream_fields,
)
from llumnix.openai_stream import EndpointKind, ResponseAssembler, openai_error
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumlet.http")

REQUEST_ID_HEADER = "X-Request-Id"
PRIORITY_HEADER = "X-Llumnix-Priority"
"""`high` marks a high-priority request (anything else, or nothing, is normal)."""
MAX_BODY_BYTES = 32 << 20


def _error(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)


def client_view(payload: dict[str, Any], body: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's stream chunk as the client would have got it without the llumlet's additions
    (token ids, usage); None when the chunk exists only because the llumlet asked for usage."""
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if not wants_usage:
        if not payload.get("choices") and payload.get("usage") is not None:
            return None
        if "usage" in payload:
            payload = {**payload, "usage": None}
    if not body.get("return_token_ids"):
        payload = {k: v for k, v in payload.items() if k != "prompt_token_ids"}
        payload["choices"] = [
            {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}
            for choice in payload.get("choices") or ()
        ]
    return payload


class HttpFront:
    def __init__(self, admission: Admission, health: HealthReporter, metrics: LlumletMetrics,
                 token: ServiceToken | None) -> None:
        """`token`: required of every caller but /health and /metrics (None: nobody is asked)."""
        self.admission = admission
        self.health = health
        self.metrics = metrics
        self.token = token

    def app(self) -> web.Application:
        middlewares = [http_middleware(self.token)] if self.token is not None else []
        return add_openai_routes(web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares),
                                 self._generate, self._models, self._health, self._metrics)

    async def _generate(self, request: web.Request, endpoint: EndpointKind) -> web.StreamResponse:
        try:
            body = await read_json_body(request, MAX_BODY_BYTES)
            if isinstance(body, dict):  # anything else: admission refuses it
                read_stream_fields(body)  # `stream`: "false" does not stream, as in vLLM
        except OpenAIRequestError as exc:
            return exc.response()
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"llumlet-{uuid.uuid4().hex}"
        high_priority = request.headers.get(PRIORITY_HEADER, "").lower() == "high"
        events = self.admission.generate(endpoint, body, request_id, high_priority)
        try:
            return await self._respond(request, endpoint, body, request_id, events)
        finally:
            # Closing an unfinished generator aborts the request on the engine (client went away).
            await events.aclose()

    async def _respond(self, request: web.Request, endpoint: EndpointKind, body: dict[str, Any],
                       request_id: str, events: AsyncGenerator[StreamEvent, None]) -> web.StreamResponse:
        try:
            first = await anext(events)
        except AdmissionError as exc:
            return _error(exc.status, exc.body)
        except StopAsyncIteration:
            return _error(502, openai_error(502, "engine ended the response without output"))
        if body.get("stream"):
            return await self._stream(request, body, first, events)
        assembler = ResponseAssembler(endpoint, str(first.payload.get("id") or request_id),
                                      bool(body.get("return_token_ids")))
        try:
            for chunk in first.chunks:
                assembler.add(chunk)
            async for event in events:
                for chunk in event.chunks:
                    assembler.add(chunk)
        except AdmissionError as exc:
            return _error(exc.status, exc.body)
        return web.json_response(assembler.response())

    async def _stream(self, request: web.Request, body: dict[str, Any], first: StreamEvent,
                      events: AsyncGenerator[StreamEvent, None]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            event = first
            while True:
                view = client_view(event.payload, body) if event.payload else None
                if view is not None:
                    await response.write(b"data: " + json.dumps(view).encode() + b"\n\n")
                event = await anext(events)
        except StopAsyncIteration:
            pass
        except AdmissionError as exc:
            # Mid-stream failures travel as an error event, as vLLM sends them.
            await response.write(b"data: " + json.dumps(exc.body).encode() + b"\n\n")
        except ConnectionResetError:
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        try:
            status, payload, content_type = await self.admission.engine.get("/v1/models")
        except EngineUnavailableError as exc:
            return _error(exc.status, exc.body)
        return web.Response(status=status, body=payload, content_type=content_type)

    async def _health(self, request: web.Request) -> web.Response:
        report = self.health.report()
        return web.json_response(report.as_json(), status=200 if report.serving else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})
