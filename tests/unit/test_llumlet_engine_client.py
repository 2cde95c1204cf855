"""The llumlet's engine client: a stream the llumlet closes while reading it (a migration's final
stage, an abort) ends with EngineUnavailableError and leaves nothing of itself behind."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from llumlet.engine_client import EngineClient, EngineUnavailableError
from llumnix.openai_stream import EndpointKind

EVENT = b'data: {"id": "cmpl-1", "object": "text_completion", "choices": []}\n\n'


async def _endless_stream(request: web.Request) -> web.StreamResponse:
    """An engine stream that never finishes by itself."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while True:
        await response.write(EVENT)
        await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[EngineClient]:
    app = web.Application()
    app.router.add_post("/v1/completions", _endless_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = EngineClient(f"http://127.0.0.1:{port}")
    yield client
    await client.close()
    await runner.cleanup()


async def _read_and_close(engine: EngineClient) -> weakref.ref[aiohttp.ClientResponse]:
    """Opens a stream, closes its response after the first event (as `Admission.suspend` does) and
    reads on until the client says the stream was dropped."""
    response = await engine.open_stream(EndpointKind.COMPLETION, {"prompt": [1], "stream": True})
    events = engine.iter_events(response)
    await anext(events)
    response.close()
    with pytest.raises(EngineUnavailableError, match="dropped the response stream"):
        await anext(events)
    return weakref.ref(response)


async def test_closed_streams_are_freed(engine: EngineClient) -> None:
    # aiohttp raises one module-level "Connection closed" error for every response closed mid-read;
    # its traceback held every such stream's frames (and so its response), ~10 KiB per migration.
    closed = [await _read_and_close(engine) for _ in range(3)]
    gc.collect()
    assert [ref() for ref in closed] == [None, None, None]
