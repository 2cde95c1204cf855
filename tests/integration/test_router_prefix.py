"""Prefix-aware dispatch through the real router, llumlets and sim engines with prefix caching on:
a request sharing a long prefix with one running on instance A goes to A, where the prefix is
cached and held (it needs only its own blocks there, and prefills only its suffix), although A has
less free memory; freeness-only dispatch sends it to the emptier instance, which recomputes the
prefix. A request with another cache salt than the cached prefix's gets no credit for it (the sim
engine salts its blocks as vLLM does, so it would not hit there either). Shown by the engines'
prefix-cache counters (vllm:prefix_cache_queries / _hits)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from prefix_requests import prefix_cache_counters, time_to_first_token
from waiting import wait_until

from llumnix.launch.pair import EnginePair
from llumnix.prefix_cache import block_hashes, root_hash
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


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                   cache_salt: str | None = None) -> float:
    body: dict[str, object] = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return await time_to_first_token(session, url, body)


async def followers_land(router: Router, pairs: list[EnginePair], seed: int, leader_salt: str | None = None,
                         follower_salts: tuple[str | None, ...] = (None, None, None)
                         ) -> list[tuple[str, float, float]]:
    """A long request with a 640-token prefix, then requests sharing that prefix one by one while it
    runs (with these cache salts): (where each follower ran relative to the long one, its cache hit
    tokens, its TTFT)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(PREFIX_BLOCKS * BLOCK)]
    hashes = block_hashes(prefix, BLOCK, root_hash(leader_salt))
    index = router.instances.prefix_index
    results = []
    async with aiohttp.ClientSession() as session:
        leader = asyncio.create_task(complete(session, router.url, [*prefix, 7], 80, leader_salt))
        await wait_until(lambda: PREFIX_BLOCKS in index.cached_blocks(hashes).values(),
                         "the router to learn where the long prefix is cached")
        (holder_id,) = index.cached_blocks(hashes)
        holder = next(p for p in pairs if p.config.instance_id == holder_id)
        for n, salt in enumerate(follower_salts):
            before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
            ttft = await complete(session, router.url, [*prefix, *([n + 1] * BLOCK)], 2, salt)
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


async def test_only_requests_with_the_prefixs_cache_salt_are_credited_for_it(
        sim_pairs: StartPairs, start_router: StartRouter) -> None:
    pairs = await sim_pairs(2, "salt", **ENGINE)
    router = await start_router([p.grpc_address for p in pairs], prefix_weight=2.0)
    landed = await followers_land(router, pairs, seed=3, leader_salt="tenant-a",
                                  follower_salts=("tenant-a", "tenant-b", None))
    print("salted prefix (where, hit tokens, ttft s):", landed)
    # Same salt: the holder, from its cache; another salt or none: no credit, so freeness decides
    # (the holder's memory is taken by the long request) and the engine finds nothing cached.
    assert [where_hits[:2] for where_hits in landed] == [("holder", PREFIX_BLOCKS * BLOCK), ("other", 0),
                                                         ("other", 0)]
    # The sim engine itself keys its cache on the salt: sent to the holder directly, only the
    # prefix's own salt hits (asked first: the others' blocks then evict the least recently used).
    rng = random.Random(3)
    prefix = [rng.randrange(1000, 30000) for _ in range(PREFIX_BLOCKS * BLOCK)]
    index = router.instances.prefix_index
    (holder_id,) = index.cached_blocks(block_hashes(prefix, BLOCK, root_hash("tenant-a")))
    holder = next(p for p in pairs if p.config.instance_id == holder_id)
    async with aiohttp.ClientSession() as session:
        for salt, hit_tokens in (("tenant-a", PREFIX_BLOCKS * BLOCK), ("tenant-c", 0), (None, 0)):
            before = await prefix_cache_counters(session, holder.engine_url)
            await complete(session, holder.engine_url, [*prefix, 9], 2, salt)
            after = await prefix_cache_counters(session, holder.engine_url)
            assert after[1] - before[1] == hit_tokens, (salt, before, after)
