"""What the prefix-dispatch tests measure: an engine's prefix-cache counters, as vLLM exposes them on
/metrics (the sim engine too), and a streamed completion's time to first token."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"


async def prefix_cache_counters(session: aiohttp.ClientSession, engine_url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens found cached) since the engine started, over its label sets."""
    async with session.get(engine_url + "/metrics") as response:
        text = await response.text()
    values = {QUERIES: 0.0, HITS: 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values[QUERIES], values[HITS]


async def time_to_first_token(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Streams one completion (`body`, with "stream" set) from `url`/v1/completions to its end."""
    started = time.monotonic()
    first = None
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for _line in response.content:
            first = first or time.monotonic()
    assert first is not None
    return first - started
