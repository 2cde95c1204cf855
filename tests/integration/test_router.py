"""The router in front of real llumlets and sim engines (processes), driven by the `openai` SDK and
plain HTTP: OpenAI responses streaming and not, the burst spread, queueing with 503 Retry-After,
limits, API keys, instances added and removed at run time, the held requests the control loop reads."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
import pytest_asyncio
from sdk_client import openai_client
from service_auth import SERVICE_TOKEN
from waiting import connection_queues, task_stacks, unwatched_selector_fds, wait_until

from llumnix.control.router_queues import RouterQueues
from llumnix.held_demand import HELD_DEMAND_PATH
from llumnix.launch.pair import EnginePair
from llumnix.router.api import ApiSettings
from llumnix.router.client_request import RequestLimits
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.instances import Instance
from llumnix.router.server import Router
from llumnix.service_token import ServiceToken

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

MODEL = "sim"
StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instances(sim_pairs: StartPairs) -> list[EnginePair]:
    return await sim_pairs(3, "sim", engine_args=("--time-scale", "5"))


@pytest_asyncio.fixture(loop_scope="module")
async def router(instances: list[EnginePair], start_router: StartRouter) -> Router:
    return await start_router([p.grpc_address for p in instances])


async def direct_completion(instance: EnginePair, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(
            instance.engine_url + "/v1/completions", json=body) as response:
        return await response.json()


async def test_openai_sdk_completions_and_chat_streaming_and_not(router: Router,
                                                                 instances: list[EnginePair]) -> None:
    client = openai_client(router.url)
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    completion = await client.completions.create(model=MODEL, prompt="The router", max_tokens=12)
    expected = await direct_completion(instances[0],
                                       {"model": MODEL, "prompt": "The router", "max_tokens": 12})
    assert completion.choices[0].text == expected["choices"][0]["text"]
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == len("The router")

    stream = await client.completions.create(model=MODEL, prompt="The router", max_tokens=12, stream=True,
                                             stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        pieces.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == completion.choices[0].text
    assert usage is not None and usage.total_tokens == len("The router") + 12

    messages = [{"role": "user", "content": "hello"}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)  # type: ignore[arg-type]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content or "") == 9
    chat_stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9,  # type: ignore[arg-type]
                                                       stream=True)
    roles, content, finish = [], [], None
    async for chunk in chat_stream:
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles.count("assistant") == 1
    assert "".join(content) == chat.choices[0].message.content and finish == "length"

    # the engine's own 4xx passes through unchanged, as an OpenAI error
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


async def test_a_burst_spreads_over_every_instance(router: Router) -> None:
    client = openai_client(router.url)
    results = await asyncio.gather(*(
        client.completions.create(model=MODEL, prompt=f"burst {i}", max_tokens=40) for i in range(12)))
    assert all(len(r.choices[0].text) == 40 for r in results)
    served = _served(router)
    assert len(served) == 3 and max(served.values()) - min(served.values()) <= 2, served


async def test_limits_and_errors_are_openai_4xx(instances: list[EnginePair],
                                               start_router: StartRouter) -> None:
    api = ApiSettings(model=MODEL,
                      limits=RequestLimits(max_body_bytes=4096, max_tokens=64, max_prompt_tokens=100))
    router = await start_router([instances[0].grpc_address], api=api)
    async with aiohttp.ClientSession() as session:
        async def post(body: object, raw: bytes | None = None) -> tuple[int, dict]:
            data = raw if raw is not None else json.dumps(body).encode()
            async with session.post(router.url + "/v1/completions", data=data,
                                    headers={"Content-Type": "application/json"}) as response:
                return response.status, await response.json()

        status, body = await post({"model": MODEL, "prompt": "x", "max_tokens": 65})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = await post({"model": MODEL, "prompt": list(range(101))})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = await post(None, raw=b"x" * 5000)
        assert status == 413 and "4096 bytes" in body["error"]["message"]
        status, body = await post(None, raw=b"{")
        assert status == 400 and body["error"]["type"] == "BadRequestError"
        status, body = await post({"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert status == 200 and len(body["choices"][0]["text"]) == 3


async def test_api_keys(instances: list[EnginePair], start_router: StartRouter) -> None:
    router = await start_router([instances[0].grpc_address], api_keys=(b"sk-good",))
    bad = openai_client(router.url, "sk-bad")
    with pytest.raises(openai.AuthenticationError) as err:
        await bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    good = openai_client(router.url, "sk-good")
    answer = await good.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert len(answer.choices[0].text) == 2
    async with aiohttp.ClientSession() as session, session.get(router.url + "/health") as response:
        assert response.status == 200  # health and metrics need no key


async def _constant(urls: list[str]) -> list[str]:
    return urls


async def test_queue_503_and_instances_added_and_removed_at_run_time(
        instances: list[EnginePair], start_router: StartRouter) -> None:
    router = await start_router([], queue_capacity=2, queue_timeout_s=30.0)
    source = router.instances.source
    assert isinstance(source, ListInstanceSource)
    async with aiohttp.ClientSession() as session:
        async with session.get(router.url + "/health") as response:
            assert response.status == 503 and (await response.json())["status"] == "no-instances"

        async def complete(i: int) -> tuple[int, dict, dict]:
            body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 4}
            async with session.post(router.url + "/v1/completions", json=body) as response:
                return response.status, dict(response.headers), await response.json()

        held = [asyncio.create_task(complete(i)) for i in range(2)]
        await wait_until(lambda: len(router.queue) == 2, "two requests held in the router's queue")
        # The control loop reads them (a router that does not answer adds none); only with the token.
        urls = ["http://127.0.0.1:1", router.url]
        queues = RouterQueues(lambda: _constant(urls), SERVICE_TOKEN)
        in_queue = router.queue.held_tokens()
        assert len(in_queue) == 2 and await queues.held_tokens() == in_queue
        async with session.get(router.url + HELD_DEMAND_PATH) as response:
            assert response.status == 401 and (await response.json())["error"]["code"] == 401
        stranger = RouterQueues(lambda: _constant(urls), ServiceToken("not-the-service-token"))
        assert await stranger.held_tokens() == []
        await queues.close()
        await stranger.close()
        status, headers, body = await complete(3)
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["type"] == "ServiceUnavailableError"

        source.set_addresses([instances[1].grpc_address])  # an instance appears: the queue drains
        for status, _, body in await asyncio.gather(*held):
            assert status == 200 and len(body["choices"][0]["text"]) == 4
        source.set_addresses([instances[2].grpc_address])  # and is replaced by another
        replaced = [instances[2].grpc_address]
        await wait_until(lambda: [i.address for i in router.instances.dispatchable()] == replaced,
                         "the router to dispatch to the new instance only")
        for _ in range(3):
            status, _, _ = await complete(9)
            assert status == 200
    served = {s.labels["instance_id"] for s in router.metrics.requests.collect()[0].samples
              if s.name.endswith("_total") and s.labels["status"] == "200"}
    assert served == {"sim-1", "sim-2"}


async def test_metrics_exposition(router: Router) -> None:
    client = openai_client(router.url)
    await client.completions.create(model=MODEL, prompt="m", max_tokens=5)
    async with aiohttp.ClientSession() as session, session.get(router.url + "/metrics") as response:
        text = await response.text()
    for name in ("llumnix_router_time_to_first_token_seconds_count",
                 "llumnix_router_e2e_latency_seconds",
                 "llumnix_router_time_per_output_token_seconds", "llumnix_router_requests_total",
                 "llumnix_router_queue_length", "llumnix_router_dispatch_decision_seconds",
                 "llumnix_router_replays_total", "llumnix_router_moves_followed_total",
                 'llumnix_router_instances{state="connected"} 3.0'):
        assert name in text, name


async def test_a_burst_of_long_text_prompts_is_placed_by_their_size_as_the_engines_tokenize_them(
        sim_pairs: StartPairs, start_router: StartRouter) -> None:
    """The sim engine's tokenizer is byte-level: 600 bytes of text are 600 tokens, not the 150 that 4
    bytes per token would say. Once the router (and each llumlet) has learnt the engines' ratio from
    the prompt lengths they report, two long prompts arriving together, before any load lists them,
    go where each fits instead of both to the emptier instance."""
    a, b = await sim_pairs(2, "sized", engine_args=("--num-blocks", "64", "--block-size", "16"))
    router = await start_router([a.grpc_address, b.grpc_address])
    client = openai_client(router.url)
    try:
        await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"warm-up {i} " * 8,
                                                         max_tokens=2) for i in range(12)))
    except openai.APIError as exc:  # a fresh-clone run saw 3 of the 12 get no answer
        raise AssertionError(f"{exc!r}; the router's view: {_router_view(router)}") from exc
    assert router.api.prompt_sizer.bytes_per_token == pytest.approx(1.0)
    # b holds 19-25 blocks for a while: a request sent to its llumlet directly (the router only sees it
    # in b's load), 300 prompt tokens and up to 100 more.
    async with _llumlet_session() as session:
        holder, _ = await _hold_blocks(session, router, b, prompt_tokens=300, max_tokens=100)
        # a has room for one 600-token prompt (38 blocks of 64), b beside the holder for one more.
        before = _served(router)
        try:
            results = await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=letter * 600, max_tokens=8) for letter in "XY"))
        except openai.APIError as exc:
            raise AssertionError(f"{exc!r}; the router's view: {_router_view(router)}") from exc
        assert all(len(r.choices[0].text) == 8 for r in results)
        after = _served(router)
        assert {name: after[name] - before[name] for name in ("sized-0", "sized-1")} == \
            {"sized-0": 1, "sized-1": 1}
        (await holder).close()


async def test_a_held_prompt_too_large_for_the_room_lets_a_small_request_pass(
        sim_pairs: StartPairs, start_router: StartRouter) -> None:
    """While a request sent to the llumlet directly holds 32 to 62 of the instance's 64 blocks (about
    24 s of decoding at half the profile's speed), a 560-token prompt (35 blocks) waits in the router's
    queue; a 20-token one sent after it is served at once instead of waiting behind it, and the large
    one is served when the room is freed."""
    (pair,) = await sim_pairs(1, "held", engine_args=("--num-blocks", "64", "--block-size", "16",
                                                      "--time-scale", "0.5"))
    router = await start_router([pair.grpc_address])
    client = openai_client(router.url)
    async with _llumlet_session() as session:
        holder, instance = await _hold_blocks(session, router, pair, prompt_tokens=500, max_tokens=480)
        large = asyncio.create_task(client.completions.create(model=MODEL, prompt=[66] * 560, max_tokens=2))
        await wait_until(lambda: len(router.queue) == 1 or large.done(), "the large prompt held")
        small = await client.completions.create(model=MODEL, prompt=[67] * 20, max_tokens=4)
        assert len(small.choices[0].text) == 4
        assert not large.done() and len(router.queue) == 1, _router_view(router)
        holder.cancel()  # its client went away: the llumlet aborts it on the engine, freeing its blocks
        await wait_until(lambda: not any(r.prompt_tokens == 500 for r in instance.effective_load().running),
                         "the holder aborted (it had about 20 s left to run)", timeout_s=10)
        assert len((await large).choices[0].text) == 2


def _llumlet_session() -> aiohttp.ClientSession:
    """For requests sent to a llumlet directly, as the service's own callers do."""
    return aiohttp.ClientSession(headers={"Authorization": SERVICE_TOKEN.authorization},
                                 timeout=aiohttp.ClientTimeout(total=90))


async def _hold_blocks(session: aiohttp.ClientSession, router: Router, pair: EnginePair, prompt_tokens: int,
                       max_tokens: int) -> tuple[asyncio.Task[aiohttp.ClientResponse], Instance]:
    """A request sent to the pair's llumlet directly (the router sees it only in the instance's load),
    running once the router's view of the instance lists it."""
    holder = asyncio.create_task(session.post(pair.llumlet.http_url + "/v1/completions", json={
        "model": MODEL, "prompt": [65] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True}))
    instance = router.instances.get(pair.grpc_address)
    assert instance is not None
    await wait_until(lambda: bool(instance.effective_load().running) or holder.done(),
                     f"{pair.grpc_address} to list the holder", timeout_s=30)
    assert not holder.done(), (await holder.result().text())
    return holder, instance


def _router_view(router: Router) -> str:
    """What the router saw of each instance and its queue, for a failure's message."""
    views = []
    for instance in router.instances.all():
        load = instance.effective_load() if instance.report is not None else None
        views.append(f"{instance.address}: dispatchable={instance.dispatchable()} idle={instance.is_idle()} "
                     f"pending={sorted(instance.pending)} in_flight={sorted(instance.in_flight)} "
                     f"ended={sorted(instance.ended)} load={load}")
    return (f"queue={len(router.queue)} api in_flight={router.api.in_flight} served={dict(_served(router))}; "
            + "; ".join(views) + f"\n{connection_queues(router.port)}\n{unwatched_selector_fds()}\n"
            + task_stacks())


def _served(router: Router) -> collections.Counter[str]:
    """Requests answered 200, by the instance that served them."""
    served: collections.Counter[str] = collections.Counter()
    for sample in router.metrics.requests.collect()[0].samples:
        if sample.name.endswith("_total") and sample.labels["status"] == "200":
            served[sample.labels["instance_id"]] += int(sample.value)
    return served
