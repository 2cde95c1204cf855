"""Waiting for a condition in a test: poll it until it holds, or fail loudly naming what was awaited.
For state that announces no event a test could await (a router's queue, its instance set)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.02


async def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(POLL_S)
