"""An engine's prefix-cache counters, as vLLM exposes them on /metrics (the sim engine too)."""

from __future__ import annotations

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
