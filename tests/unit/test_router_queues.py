"""The control loop's read of the routers' held requests when the routers cannot be listed, or one
is too slow to answer or gone: the decision goes on without waiting for them (reads of live
routers: tests/integration/test_router.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from llumnix.control.router_queues import STALE_S, RouterQueues
from llumnix.held_demand import CONTENT_TYPE, HELD_DEMAND_PATH, held_demand_to_bytes
from llumnix.launch.pair import free_port


async def test_routers_that_cannot_be_listed_add_no_held_request(caplog: pytest.LogCaptureFixture) -> None:
    async def api_server_down() -> list[str]:
        raise ConnectionRefusedError("the API server is down")

    queues = RouterQueues(api_server_down, None)
    with caplog.at_level(logging.WARNING, logger="llumnix.control"):
        assert await queues.held_tokens() == []
    assert "cannot list the routers" in caplog.text
    await queues.close()


async def test_a_router_too_slow_to_answer_counts_its_recent_answer_and_a_gone_one_none() -> None:
    answered_once = asyncio.Event()
    released = asyncio.Event()

    async def held_demand(request: web.Request) -> web.Response:
        if answered_once.is_set():
            await released.wait()  # a router too busy to answer within the read timeout
        answered_once.set()
        return web.Response(body=held_demand_to_bytes([480, 160]), content_type=CONTENT_TYPE)

    app = web.Application()
    app.router.add_get(HELD_DEMAND_PATH, held_demand)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    now = [100.0]
    queues = RouterQueues(lambda: _constant([f"http://127.0.0.1:{port}", gone]), None, clock=lambda: now[0])
    try:
        assert await queues.held_tokens() == [480, 160]
        now[0] += STALE_S  # no answer in time: its last one, still recent
        assert await queues.held_tokens() == [480, 160]
        now[0] += 0.1  # the last answer is too old now
        assert await queues.held_tokens() == []
    finally:
        released.set()
        await queues.close()
        await runner.cleanup()


async def _constant(urls: list[str]) -> list[str]:
    return urls
