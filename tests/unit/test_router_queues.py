"""The control loop's read of the routers' held requests when the routers cannot be listed, or one
is too slow to answer or gone: the decision goes on without waiting for them (reads of live
routers: tests/integration/test_router.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from llumnix.control.router_queues import LISTING_TTL_S, STALE_S, RouterQueues
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


async def test_the_routers_are_listed_again_only_after_the_listing_ttl() -> None:
    listings = 0
    now = [100.0]

    async def routers() -> list[str]:  # the operator asks the Kubernetes API for the router pods
        nonlocal listings
        listings += 1
        return []

    queues = RouterQueues(routers, None, clock=lambda: now[0])
    try:
        for _ in range(3):  # the migration pass reads every 100 ms
            assert await queues.held_tokens() == []
            now[0] += 0.1
        assert listings == 1
        now[0] += LISTING_TTL_S
        await queues.held_tokens()
        assert listings == 2
    finally:
        await queues.close()


async def _router(body: bytes, answers: int) -> tuple[web.AppRunner, str, asyncio.Event]:
    """A router serving `body` for its first `answers` reads, then too busy to answer any until the
    event is set."""
    served = 0
    stuck = asyncio.Event()

    async def held_demand(request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        if served > answers:
            await stuck.wait()
        return web.Response(body=body, content_type=CONTENT_TYPE)

    app = web.Application()
    app.router.add_get(HELD_DEMAND_PATH, held_demand)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", stuck


async def test_a_router_too_slow_to_answer_counts_its_recent_answer_and_a_gone_one_none() -> None:
    slow, slow_url, unstick = await _router(held_demand_to_bytes([480, 160]), answers=1)
    gone, gone_url, _ = await _router(held_demand_to_bytes([32]), answers=1)
    now = [100.0]

    async def routers() -> list[str]:
        return [slow_url, gone_url]

    queues = RouterQueues(routers, None, clock=lambda: now[0])
    try:
        assert await queues.held_tokens() == [480, 160, 32]
        await gone.cleanup()  # its connection is refused from now on: its requests went with it
        now[0] += STALE_S  # the slow one does not answer in time: its last answer, still recent
        assert await queues.held_tokens() == [480, 160]
        now[0] += 0.1  # its last answer is too old now
        assert await queues.held_tokens() == []
    finally:
        await queues.close()
        unstick.set()
        await slow.cleanup()
