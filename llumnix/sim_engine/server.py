"""The sim engine's HTTP server: the subset of vLLM's OpenAI server that the llumlet uses (completions
and chat completions, streaming and not; /v1/models, /health, /metrics), on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llumnix.engine.snapshots import SnapshotPublisher
from llumnix.openai_request import add_openai_routes
from llumnix.openai_stream import EndpointKind
from llumnix.profile import load_profile
from llumnix.sim.instance import DEFAULT_WATERMARK, EngineConfig, SimInstance
from llumnix.sim_engine.engine import Generation, SimEngine
from llumnix.sim_engine.metrics import EngineMetrics
from llumnix.sim_engine.migration import DEFAULT_KV_BYTES_PER_BLOCK, SimMigrationAgent
from llumnix.sim_engine.requests import RequestError, parse_request, type_error
from llumnix.sim_engine.responses import ResponseWriter
from llumnix.sim_engine.tokens import TokenGenerator

logger = logging.getLogger("llumnix.sim_engine")

DEFAULT_MAX_MODEL_LEN = 4096
MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    model: str = "sim"
    profile: str = "llama-7b-a10"
    host: str = "127.0.0.1"
    port: int = 8000
    kv_host: str | None = None
    """Where the KV receiver listens, reachable by peer engines (None: `host`). In a pod: the pod IP,
    while the HTTP API stays on localhost behind the llumlet."""
    num_blocks: int | None = None
    """Default: the profile's KV capacity."""
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    """Default: 4096, or less when the block pool holds less."""
    time_scale: float = 1.0
    snapshot_addr: str | None = None
    engine_id: str = "sim-engine"
    seed: int = 0
    eos_probability: float = 0.0
    priority_scheduling: bool = False
    kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK
    """Size of the fake KV payload per block that migrations send."""
    prefix_caching: bool = False
    """vLLM's automatic prefix caching (blocks by content hash, reported in the snapshots)."""
    watermark: float = DEFAULT_WATERMARK
    """Share of the blocks kept free when admitting a prompt (vLLM v0's 1%; vLLM 0.32's `--watermark`
    is 0 unless set)."""


def _dumps(body: Any) -> str:
    # pydantic's compact JSON, as vLLM writes it
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(body), status=status, content_type="application/json")


def build_engine(
    config: SimEngineConfig, snapshot_sink: Callable[[Any], None] | None
) -> tuple[SimEngine, int]:
    """The engine and its max model length; `ValueError` with a readable message for bad settings."""
    profile = load_profile(config.profile)
    block_size = config.block_size or profile.block_size
    num_blocks = config.num_blocks or profile.kv_capacity_tokens // block_size
    if block_size < 1 or num_blocks < 1:
        raise ValueError("--block-size and --num-blocks must be positive")
    engine_config = EngineConfig(
        total_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=config.max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        prefix_caching=config.prefix_caching,
        watermark=config.watermark,
    )
    # A sequence of the maximum length must fit the pool above the admission watermark.
    usable_tokens = engine_config.admission_blocks * block_size
    max_model_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, usable_tokens)
    if max_model_len < 1 or math.ceil(max_model_len / block_size) > engine_config.admission_blocks:
        raise ValueError(
            f"--max-model-len {max_model_len} does not fit the KV cache: {num_blocks} blocks of "
            f"{block_size} tokens leave {usable_tokens} tokens above the {config.watermark:.0%} admission "
            "watermark; lower --max-model-len or raise --num-blocks"
        )
    instance = SimInstance(config.engine_id, engine_config, profile.iteration_time)
    engine = SimEngine(
        instance,
        TokenGenerator(config.seed, config.eos_probability),
        time_scale=config.time_scale,
        engine_id=config.engine_id,
        snapshot_sink=snapshot_sink,
        priority_scheduling=config.priority_scheduling,
    )
    return engine, max_model_len


@web.middleware
async def _fastapi_style_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown paths and methods answer as vLLM's FastAPI server does."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status in (404, 405):
            return _json({"detail": exc.reason}, status=exc.status)
        raise


class SimEngineServer:
    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self._publisher = SnapshotPublisher(config.snapshot_addr) if config.snapshot_addr else None
        self.engine, self.max_model_len = build_engine(
            config, self._publisher.publish if self._publisher else None
        )
        self.metrics = EngineMetrics(self.engine, config.model)
        # Migration needs the command and event sockets next to an ipc:// snapshot socket.
        if config.snapshot_addr and config.snapshot_addr.startswith("ipc://"):
            self.engine.migration = SimMigrationAgent(self.engine, config.snapshot_addr,
                                                      config.kv_host or config.host,
                                                      config.model, config.kv_bytes_per_block)
        self.started = int(time.time())
        self._engine_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_fastapi_style_errors])
        return add_openai_routes(app, self._generate, self._models, self._health, self._metrics)

    # ----- generation

    async def _generate(self, request: web.Request, endpoint: EndpointKind) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            position = getattr(exc, "pos", 0)
            error = type_error(str(position), "json_invalid", "JSON decode error", {})
            return _json(error.body, status=error.status)
        try:
            params = parse_request(endpoint, body, self.config.model, self.max_model_len)
        except RequestError as exc:
            return _json(exc.body, status=exc.status)
        response_id = f"{'chatcmpl' if endpoint is EndpointKind.CHAT else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        # vLLM's engine ids: a completion's n-th prompt is "<response id>-<n>", a chat is the response id.
        engine_request_id = response_id if endpoint is EndpointKind.CHAT else f"{response_id}-0"
        generation = self.engine.add(engine_request_id, params)
        writer = ResponseWriter(params, response_id, int(time.time()), self.config.model)
        try:
            if params.stream:
                return await self._stream(request, generation, writer)
            return await self._whole(generation, writer)
        finally:
            # A client that went away (the handler is cancelled, or a write failed) frees its blocks.
            self.engine.abort(generation)

    async def _whole(self, generation: Generation, writer: ResponseWriter) -> web.Response:
        text: list[str] = []
        while True:
            delta = await generation.outputs.get()
            text.append(delta.text)
            if delta.finish_reason is not None:
                return _json(
                    writer.response(
                        "".join(text), generation.output_ids, delta.finish_reason, delta.stop_reason
                    )
                )

    async def _stream(
        self, request: web.Request, generation: Generation, writer: ResponseWriter
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            while True:
                delta = await generation.outputs.get()
                events = [f"data: {_dumps(chunk)}\n\n" for chunk in writer.chunks(delta)]
                if delta.finish_reason is not None:
                    if generation.params.include_usage:
                        events.append(f"data: {_dumps(writer.usage_chunk(len(generation.output_ids)))}\n\n")
                    events.append("data: [DONE]\n\n")
                await response.write("".join(events).encode())
                if delta.finish_reason is not None:
                    break
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; the caller aborts the request
        return response

    # ----- the rest of the API

    async def _models(self, request: web.Request) -> web.Response:
        model = self.config.model
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": self.started,
                        "owned_by": "llumnix",
                        "root": model,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                                "object": "model_permission",
                                "created": self.started,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": False,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        alive = self._engine_task is not None and not self._engine_task.done()
        return web.Response(status=200 if alive else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    # ----- lifecycle

    async def serve_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Handlers are cancelled when their client disconnects, so a dropped non-streaming request
        # is aborted like in vLLM.
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        if self.engine.migration is not None:
            self.engine.migration.start()
        self._engine_task = asyncio.create_task(self.engine.run(), name="sim-engine-steps")
        self._engine_task.add_done_callback(_log_crash)
        try:
            await web.TCPSite(runner, self.config.host, self.config.port).start()
            logger.info(
                "sim engine %s serving %s on http://%s:%d (%d blocks of %d tokens, max model len %d)",
                self.config.engine_id,
                self.config.model,
                self.config.host,
                self.config.port,
                self.engine.instance.total_blocks,
                self.engine.instance.block_size,
                self.max_model_len,
            )
            await stop.wait()
        finally:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
            await runner.cleanup()
            if self.engine.migration is not None:
                self.engine.migration.close()
            if self._publisher is not None:
                self._publisher.close()


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("sim engine step loop failed; /health now answers 503", exc_info=task.exception())
