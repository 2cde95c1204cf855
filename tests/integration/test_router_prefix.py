"""Prefix-aware dispatch through the real router, llumlets and sim engines with prefix caching on:
a request sharing a long prefix with one running on instance A goes to A, where the prefix is
cached and held (it needs only its own blocks there, and prefills only its suffix), although A has
less free memory; freeness-only dispatch sends it to the emptier instance, which recomputes the
prefix. Shown by the engines' prefix-cache counters (vllm:prefix_cache_queries / _hits)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from prefix_requests import prefix_cache_counters, time_to_first_token
from waiting import wait_until

from llumnix.launch.pair import EnginePair
from llumnix.prefix_cache import block_hashes
from llumnix.router.server import Router

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]
BLOCK = 16
PREFIX_BLOCKS = 40
# 96 blocks each; time runs at a quarter of the profile's speed, so the long request outlives the
# ones that follow it (it holds the shared prefix while they arrive).
ENGINE = {"num_blocks": 96, "block_size": BLOCK, "max_model_len": 1400,
          "engine_args": ("--time-scale", "0.25", "--enable-prefix-caching")}


async def complete(session: aiohttp.ClientSession, router: Router, prompt: list[int], max_tokens: int
                   ) -> float:
    return await time_to_first_token(session, router.url, {"model": "sim", "prompt": prompt,
                                                           "max_tokens": max_tokens})


async def followers_land(router: Router, pairs: list[EnginePair], seed: int
                         ) -> list[tuple[str, float, float]]:
    """A long request with a 640-token prefix, then requests sharing that prefix one by one while it
    runs: (where each follower ran relative to the long one, its cache hit tokens, its TTFT)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(PREFIX_BLOCKS * BLOCK)]
    hashes = block_hashes(prefix, BLOCK)
    index = router.instances.prefix_index
    results = []
    async with aiohttp.ClientSession() as session:
        leader = asyncio.create_task(complete(session, router, [*prefix, 7], max_tokens=80))
        await wait_until(lambda: PREFIX_BLOCKS in index.cached_blocks(hashes).values(),
                         "the router to learn where the long prefix is cached")
        (holder_id,) = index.cached_blocks(hashes)
        holder = next(p for p in pairs if p.config.instance_id == holder_id)
        for n in range(3):
            before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
            ttft = await complete(session, router, [*prefix, *([n + 1] * BLOCK)], max_tokens=2)
            after = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
            served = [iid for iid in after if after[iid][0] > before[iid][0]]
            assert len(served) == 1, (before, after)
            hits = after[served[0]][1] - before[served[0]][1]
            results.append(("holder" if served[0] == holder.config.instance_id else "other", hits, ttft))
        assert not leader.done(), "the long request ended before the followers were dispatched"
        await leader
    return results


async def test_requests_sharing_a_prefix_go_where_it_is_cached(sim_pairs: StartPairs,
                                                               start_router: StartRouter) -> None:
    pairs = await sim_pairs(2, "prefix", **ENGINE)
    addresses = [p.grpc_address for p in pairs]
    aware = await followers_land(await start_router(addresses, prefix_weight=2.0), pairs, seed=1)
    blind = await followers_land(await start_router(addresses, prefix_weight=0.0), pairs, seed=2)
    print("prefix-aware (where, hit tokens, ttft s):", aware)
    print("freeness-only (where, hit tokens, ttft s):", blind)
    assert [where for where, _, _ in aware] == ["holder"] * 3
    assert all(hits == PREFIX_BLOCKS * BLOCK for _, hits, _ in aware)
    # Freeness alone: the holder's memory is taken by the long request, the follower goes elsewhere
    # and recomputes the prefix there.
    assert blind[0][:2] == ("other", 0)
