"""Prefix-aware dispatch on two real CPU vLLM engines (tiny model, prefix caching on, KV cache events
translated by the connector): after one request with a long prompt, requests sharing that prompt's
prefix all go to the engine that has it cached: token-id prompts, and text and chat prompts with the
model's tokenizer in the router (its tokenization names the very blocks the engine reported). Shown by
the engines' own counters (vllm:prefix_cache_queries / vllm:prefix_cache_hits): the other engine is
never asked, the holder serves each follower's prefix from its cache. A salted prompt's blocks, as
vLLM's KV events report them, are the very blocks the router hashes for it (chained from the salt's
root); only a request with the same salt is credited with them, and vLLM's counters agree with the
router's prediction for each. Times to first token are printed (a cache hit skips the prefix's
prefill); nothing here depends on how fast the engines are."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prefix_requests import prefix_cache_counters, time_to_first_token
from service_auth import SERVICE_TOKEN
from waiting import wait_until

from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.openai_stream import EndpointKind
from llumnix.prefix_cache import block_hashes, cacheable_blocks, root_hash
from llumnix.router.api import ApiSettings
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router, RouterConfig

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(1200),  # two engines start first
]

BLOCK = 32  # the pairs' CPU block size
PREFIX_BLOCKS = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pairs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[list[EnginePair]]:
    work = tmp_path_factory.mktemp("prefix-vllm")
    started = [EnginePair(PairConfig(instance_id=name, work_dir=work / name, model_dir=tiny_model_dir,
                                     service_token=SERVICE_TOKEN, shutdown_grace_s=5.0,
                                     engine_start_timeout_s=900.0))
               for name in ("a", "b")]
    try:
        await asyncio.gather(*(p.start() for p in started))
        yield started
    finally:
        await asyncio.gather(*(p.stop() for p in started), return_exceptions=True)


async def _started_router(pairs: list[EnginePair], tokenizer: str | None = None) -> Router:
    """A router over the pairs (the caller shuts it down)."""
    config = RouterConfig(api=ApiSettings(model="tiny"), host="127.0.0.1", port=0,
                          service_token=SERVICE_TOKEN, tokenizer=tokenizer)
    router = Router(config, ListInstanceSource([p.grpc_address for p in pairs]))
    await router.start()
    return router


async def ttft(session: aiohttp.ClientSession, router: Router, prompt: list[int]) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    return await time_to_first_token(session, router.url, body)


async def test_requests_sharing_a_prefix_go_to_the_engine_that_caches_it(pairs: list[EnginePair]) -> None:
    router = await _started_router(pairs)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 300) for _ in range(PREFIX_BLOCKS * BLOCK)]
    hashes = block_hashes(prefix, BLOCK)
    index = router.instances.prefix_index
    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == 2, "both load streams", 60.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            for pair in pairs:  # a first request pays for warm-up: not the prefix's prefill
                async with session.post(pair.engine_url + "/v1/completions",
                                        json={"model": "tiny", "prompt": [5] * 8, "max_tokens": 2}) as warm:
                    assert warm.status == 200, await warm.text()
            leader = await ttft(session, router, [*prefix, 1])
            # The engine reports the blocks (KV events -> snapshot -> llumlet -> load stream).
            await wait_until(lambda: PREFIX_BLOCKS in index.cached_blocks(hashes).values(),
                             "the router to learn which engine caches the prefix", 60.0)
            (holder_id,) = index.cached_blocks(hashes)
            holder = next(p for p in pairs if p.config.instance_id == holder_id)
            other = next(p for p in pairs if p is not holder)
            before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
            followers = [await ttft(session, router, [*prefix, *([n + 2] * BLOCK)]) for n in range(4)]
            after = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
    finally:
        await router.shutdown()
    print(f"TTFT s: first request (prefix computed) {leader:.3f}; followers (prefix cached) "
          f"{', '.join(f'{t:.3f}' for t in followers)}")
    queried = after[holder_id][0] - before[holder_id][0]
    hits = after[holder_id][1] - before[holder_id][1]
    assert after[other.config.instance_id] == before[other.config.instance_id]  # never asked
    assert queried == 4 * (PREFIX_BLOCKS + 1) * BLOCK
    assert hits == 4 * PREFIX_BLOCKS * BLOCK, (queried, hits)


async def test_text_and_chat_prompts_go_where_their_prefix_is_cached_with_the_models_tokenizer(
        pairs: list[EnginePair], tiny_model_dir: Path) -> None:
    router = await _started_router(pairs, tokenizer=str(tiny_model_dir))
    rng = random.Random(1)
    system = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(160))
    index = router.instances.prefix_index
    prompt_ids = router.dispatcher.prompt_ids

    def chat(question: str) -> dict[str, object]:
        return {"messages": [{"role": "system", "content": system[::-1]},
                             {"role": "user", "content": question}]}

    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == 2, "both load streams", 60.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            for endpoint, kind, leader_body, follower in (
                ("/v1/completions", EndpointKind.COMPLETION, {"prompt": system + " first"},
                 lambda n: {"prompt": f"{system} question {n}"}),
                ("/v1/chat/completions", EndpointKind.CHAT, chat("hi"), lambda n: chat(f"question {n}")),
            ):
                body = {"model": "tiny", "max_tokens": 2, **leader_body}
                async with session.post(router.url + endpoint, json=body) as response:
                    assert response.status == 200, await response.text()
                # The router's tokenization names the very blocks the engine reported (vLLM's token ids).
                tokens = prompt_ids(kind, body)
                hashes = block_hashes(tokens[: (len(tokens) - 1) // BLOCK * BLOCK], BLOCK)
                assert len(hashes) >= 10
                await wait_until(lambda h=hashes: len(h) in index.cached_blocks(h).values(),
                                 f"the router to find the {endpoint} prompt's blocks it tokenized", 60.0)
                (holder_id,) = (iid for iid, n in index.cached_blocks(hashes).items() if n == len(hashes))
                before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url)
                          for p in pairs}
                for n in range(3):
                    body = {"model": "tiny", "max_tokens": 2, **follower(n)}
                    async with session.post(router.url + endpoint, json=body) as response:
                        assert response.status == 200, await response.text()
                after = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url)
                         for p in pairs}
                other_id = next(p.config.instance_id for p in pairs if p.config.instance_id != holder_id)
                assert after[other_id] == before[other_id], endpoint  # never asked
                hits = after[holder_id][1] - before[holder_id][1]
                assert hits >= 3 * (len(hashes) - 2) * BLOCK, (endpoint, hits)  # all but the last blocks
    finally:
        await router.shutdown()


async def test_a_salted_prefix_is_reported_and_predicted_as_vllm_keys_it(pairs: list[EnginePair]) -> None:
    router = await _started_router(pairs)
    rng = random.Random(2)
    prefix = [rng.randrange(10, 300) for _ in range(PREFIX_BLOCKS * BLOCK)]
    index = router.instances.prefix_index
    prompt_ids = router.dispatcher.prompt_ids

    def body(tail: list[int], salt: str | None) -> dict[str, object]:
        return {"model": "tiny", "prompt": [*prefix, *tail], "max_tokens": 2,
                **({} if salt is None else {"cache_salt": salt})}

    def predicted(request: dict[str, object]) -> dict[str, int]:
        """The router's own view: its hashes of the request, looked up in what the engines reported."""
        tokens = prompt_ids(EndpointKind.COMPLETION, request)
        cacheable = cacheable_blocks(len(tokens), BLOCK) * BLOCK
        return index.cached_blocks(block_hashes(tokens[:cacheable], BLOCK, prompt_ids.root(request)))

    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == 2, "both load streams", 60.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.post(router.url + "/v1/completions", json=body([1], "tenant-a")) as response:
                assert response.status == 200, await response.text()
            # vLLM's events for the salted prompt, translated, name the router's salted hashes; the
            # unsalted chain of the same tokens is cached nowhere.
            salted = block_hashes(prefix, BLOCK, root_hash("tenant-a"))
            await wait_until(lambda: PREFIX_BLOCKS in index.cached_blocks(salted).values(),
                             "the router to find the salted prompt's blocks", 60.0)
            (holder_id,) = index.cached_blocks(salted)
            assert index.cached_blocks(block_hashes(prefix, BLOCK)) == {}
            outcomes = []
            for n, salt in enumerate(("tenant-a", "tenant-b", None)):
                request = body([n + 2] * BLOCK, salt)
                expected = predicted(request)
                before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url)
                          for p in pairs}
                async with session.post(router.url + "/v1/completions", json=request) as response:
                    assert response.status == 200, await response.text()
                after = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url)
                         for p in pairs}
                (served,) = (iid for iid in after if after[iid][0] > before[iid][0])
                outcomes.append((salt, served == holder_id, expected.get(served, 0) * BLOCK,
                                 after[served][1] - before[served][1]))
    finally:
        await router.shutdown()
    print("(salt, on the holder, router's predicted hit tokens, vLLM's hit tokens):", outcomes)
    # The same salt goes to the holder and hits the whole prefix there; another salt or none is
    # credited nothing and vLLM finds nothing cached, wherever it goes.
    assert outcomes[0] == ("tenant-a", True, PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK)
    assert [(salt, predicted_hits, hits) for salt, _, predicted_hits, hits in outcomes[1:]] == [
        ("tenant-b", 0, 0), (None, 0, 0)]


async def test_a_truncated_prompt_is_predicted_as_vllm_keeps_it(pairs: list[EnginePair]) -> None:
    """`truncate_prompt_tokens` keeps the prompt's last N ids: a prompt whose head is new but whose kept
    tail starts with a cached prefix hits it, and the router predicts exactly vLLM's hit."""
    router = await _started_router(pairs)
    rng = random.Random(3)
    prefix = [rng.randrange(10, 300) for _ in range(PREFIX_BLOCKS * BLOCK)]
    index = router.instances.prefix_index
    prompt_ids = router.dispatcher.prompt_ids
    tail = [7] * BLOCK
    request = {"model": "tiny", "prompt": [*([3] * 4 * BLOCK), *prefix, *tail], "max_tokens": 2,
               "truncate_prompt_tokens": len(prefix) + len(tail)}
    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == 2, "both load streams", 60.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            leader = {"model": "tiny", "prompt": [*prefix, 1], "max_tokens": 2}
            async with session.post(router.url + "/v1/completions", json=leader) as response:
                assert response.status == 200, await response.text()
            hashes = block_hashes(prefix, BLOCK)
            await wait_until(lambda: PREFIX_BLOCKS in index.cached_blocks(hashes).values(),
                             "the router to learn which engine caches the prefix", 60.0)
            (holder_id,) = index.cached_blocks(hashes)
            tokens = prompt_ids(EndpointKind.COMPLETION, request)
            assert tokens == (*prefix, *tail)
            expected = index.cached_blocks(block_hashes(tokens[:cacheable_blocks(len(tokens), BLOCK) * BLOCK],
                                                        BLOCK))
            before = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
            async with session.post(router.url + "/v1/completions", json=request) as response:
                assert response.status == 200, await response.text()
                usage = (await response.json())["usage"]
            after = {p.config.instance_id: await prefix_cache_counters(session, p.engine_url) for p in pairs}
    finally:
        await router.shutdown()
    (served,) = (iid for iid in after if after[iid][0] > before[iid][0])
    assert usage["prompt_tokens"] == len(prefix) + len(tail)  # vLLM kept the last N, as predicted
    assert served == holder_id
    assert expected == {holder_id: PREFIX_BLOCKS}
    assert after[served][1] - before[served][1] == PREFIX_BLOCKS * BLOCK
