"""The control loop's read of the routers' held requests when the routers cannot be listed: the
decision goes on without them (reads of live routers: tests/integration/test_router.py)."""

from __future__ import annotations

import logging

import pytest

from llumnix.control.router_queues import RouterQueues


async def test_routers_that_cannot_be_listed_add_no_held_request(caplog: pytest.LogCaptureFixture) -> None:
    async def api_server_down() -> list[str]:
        raise ConnectionRefusedError("the API server is down")

    queues = RouterQueues(api_server_down, None)
    with caplog.at_level(logging.WARNING, logger="llumnix.control"):
        assert await queues.held_tokens() == []
    assert "cannot list the routers" in caplog.text
    await queues.close()
