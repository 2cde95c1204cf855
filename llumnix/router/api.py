"""The router's HTTP API: OpenAI `/v1/completions`, `/v1/chat/completions` (streaming and not),
`/v1/models`, plus `/health`, `/metrics` and, for the control loop, the requests it holds
(`llumnix.held_demand`)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llumnix.held_demand import CONTENT_TYPE, HELD_DEMAND_PATH, held_demand_to_bytes
from llumnix.openai_request import Handler, OpenAIRequestError, PromptSizer, add_openai_routes, read_json_body
from llumnix.openai_stream import EndpointKind, GenerationChunk, ResponseAssembler, openai_error
from llumnix.router.api_keys import ApiKeyChecker
from llumnix.router.client_request import PrioritySettings, RequestLimits, parse_client_request
from llumnix.router.dispatcher import DispatchQueue
from llumnix.router.errors import RouterError
from llumnix.router.generation import ClientRequest, Generation, GenerationLimits
from llumnix.router.instances import InstanceSet
from llumnix.router.metrics import RouterMetrics
from llumnix.router.openapi import openapi_document
from llumnix.router.stream_format import StreamFormat, sse_event
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumnix.router.api")

UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


@dataclass(frozen=True, slots=True)
class ApiSettings:
    model: str
    limits: RequestLimits = field(default_factory=RequestLimits)
    priorities: PrioritySettings = field(default_factory=PrioritySettings)
    generation: GenerationLimits = field(default_factory=GenerationLimits)


def error_response(error: OpenAIRequestError) -> web.Response:
    headers = {}
    if isinstance(error, RouterError) and error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return web.json_response(error.body, status=error.status, headers=headers)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method) and anything unforeseen, in OpenAI's shape:
    a client never gets a plain-text error or a stack trace."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(openai_error(exc.status, exc.reason), status=exc.status, headers=headers)
    except Exception:
        logger.exception("request failed in the router", extra={"path": request.path})
        return web.json_response(openai_error(500, "the router failed serving the request"), status=500)


class RouterApi:
    def __init__(self, settings: ApiSettings, queue: DispatchQueue, instances: InstanceSet,
                 metrics: RouterMetrics, api_keys: ApiKeyChecker, service_token: ServiceToken | None = None
                 ) -> None:
        """`service_token`: what the control loop presents to read the held demand (None: anyone may)."""
        self.settings = settings
        self.queue = queue
        self.instances = instances
        self.metrics = metrics
        self.api_keys = api_keys
        self.service_token = service_token
        self.prompt_sizer = PromptSizer()
        """Learns the engines' text size of a token from the prompt lengths they report."""
        self.accepting = True
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.limits.max_body_bytes,
                              middlewares=[_openai_errors, self._auth])
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get(HELD_DEMAND_PATH, self._held_demand)
        return add_openai_routes(app, self._serve, self._models, self._health, self._metrics)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        if request.path == HELD_DEMAND_PATH:  # the service's own callers, not its clients
            if self.service_token is None or self.service_token.accepts(authorization):
                return await handler(request)
            return web.json_response(openai_error(401, "this path takes the service token"), status=401)
        if request.path in UNAUTHENTICATED_PATHS or self.api_keys.allows(authorization):
            return await handler(request)
        return web.json_response({"error": {
            "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, status=401)

    async def _held_demand(self, _: web.Request) -> web.Response:
        return web.Response(body=held_demand_to_bytes(self.queue.held_tokens()), content_type=CONTENT_TYPE)

    async def _serve(self, request: web.Request, endpoint: EndpointKind) -> web.StreamResponse:
        arrival = time.monotonic()
        if not self.accepting:
            return error_response(RouterError(503, "the router is shutting down; retry", retry_after_s=1.0))
        try:
            body = await read_json_body(request, self.settings.limits.max_body_bytes)
            client_request = parse_client_request(endpoint, body, request.headers, self.settings.limits,
                                                  self.settings.priorities, self.prompt_sizer.bytes_per_token)
        except OpenAIRequestError as exc:
            return error_response(exc)
        self.in_flight += 1
        self.idle.clear()
        self.metrics.in_flight.inc()
        generation = Generation(client_request, self.queue, self.instances, self.metrics,
                                self.settings.generation, self.prompt_sizer)
        status = 500
        try:
            response, status = await self._respond(request, client_request, generation)
            return response
        finally:
            self._finished(client_request, generation, status, arrival)

    def _finished(self, client_request: ClientRequest, generation: Generation, status: int,
                  arrival: float) -> None:
        now = time.monotonic()
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0:
            self.idle.set()
        self.metrics.requests.labels(str(status), generation.instance_id).inc()
        if status == 200:
            self.metrics.e2e.observe(now - arrival)
            if generation.first_token_at is not None:
                self.metrics.ttft.observe(generation.first_token_at - arrival)
                tokens = generation.out.tokens
                if tokens > 1:
                    self.metrics.tpot.observe((now - generation.first_token_at) / (tokens - 1))
        logger.debug("request finished", extra={"request_id": client_request.request_id, "status": status,
                                               "instance_id": generation.instance_id,
                                               "tokens": generation.out.tokens})

    async def _respond(self, request: web.Request, client_request: ClientRequest, generation: Generation
                       ) -> tuple[web.StreamResponse, int]:
        batches = generation.batches()
        try:
            try:
                first = await anext(batches)
            except StopAsyncIteration:
                error = RouterError(502, "the instance ended the response without output")
                return error_response(error), error.status
            except RouterError as exc:
                return error_response(exc), exc.status
            body = client_request.body
            response_id = ("chatcmpl-" if client_request.endpoint is EndpointKind.CHAT else "cmpl-") \
                + client_request.request_id.removeprefix("router-")
            if body.get("stream"):
                return await self._stream(request, client_request, generation, first, batches, response_id)
            assembler = ResponseAssembler(client_request.endpoint, response_id,
                                          bool(body.get("return_token_ids")))
            try:
                for chunk in first:
                    assembler.add(chunk)
                async for batch in batches:
                    for chunk in batch:
                        assembler.add(chunk)
            except RouterError as exc:
                return error_response(exc), exc.status
            assembler.usage = generation.final_usage()
            assembler.model = generation.model or assembler.model
            return web.json_response(assembler.response()), 200
        finally:
            await batches.aclose()

    async def _stream(self, request: web.Request, client_request: ClientRequest, generation: Generation,
                      first: list[GenerationChunk], batches: AsyncIterator[list[GenerationChunk]],
                      response_id: str
                      ) -> tuple[web.StreamResponse, int]:
        body = client_request.body
        fmt = StreamFormat(client_request.endpoint, response_id, int(time.time()),
                           bool(body.get("return_token_ids")))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        status = 200
        try:
            # One write per batch: a batch is what arrived together from the instance.
            await response.write(fmt.events(first, generation.model))
            try:
                async for batch in batches:
                    await response.write(fmt.events(batch, generation.model))
            except RouterError as exc:
                # After the first byte a failure travels as an error event, as vLLM sends it.
                status = exc.status
                await response.write(sse_event(exc.body))
            else:
                if (body.get("stream_options") or {}).get("include_usage"):
                    await response.write(sse_event(fmt.usage(generation.final_usage(), generation.model)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            status = 499  # the client went away; closing the generator aborts the request
        return response, status

    async def _openapi(self, request: web.Request) -> web.Response:
        settings = self.settings
        return web.json_response(openapi_document(settings.model, settings.limits, settings.priorities))

    async def _models(self, request: web.Request) -> web.Response:
        model: dict[str, Any] = {"id": self.settings.model, "object": "model", "created": int(time.time()),
                                 "owned_by": "llumnix", "root": self.settings.model, "parent": None}
        if self.settings.generation.max_model_len is not None:
            model["max_model_len"] = self.settings.generation.max_model_len
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        ready = len(self.instances.dispatchable())
        connected, total = self.instances.counts()
        status = "shutting-down" if not self.accepting else ("ok" if ready else "no-instances")
        return web.json_response({"status": status, "instances_ready": ready,
                                  "instances_connected": connected, "instances": total,
                                  "queue_length": len(self.queue),
                                  "in_flight": self.in_flight, "pid": os.getpid()},
                                 status=200 if status == "ok" else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        connected, total = self.instances.counts()
        self.metrics.instances.labels("connected").set(connected)
        self.metrics.instances.labels("down").set(total - connected)
        return web.Response(body=self.metrics.exposition(), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})

