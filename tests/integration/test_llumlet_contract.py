"""The llumlet contract, on real engines: two engine + llumlet pairs per engine kind (CPU vLLM with
the llumnix connector, and the sim engine).

Pair "a" runs with the engine's default batch limit, pair "b" with at most two running requests so
that requests queue. Tests share the pairs (module scope); the destructive ones (SIGTERM, engine
death) come last and use pair "b".
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from waiting import wait_until

from llumlet.engine_metrics import parse_engine_metrics
from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.load import blocks_for_tokens
from llumnix.sim.instance import EngineConfig
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc

VLLM_MISSING = importlib.util.find_spec("vllm") is None

ENGINE_KINDS = [
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
        VLLM_MISSING, reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)")]),
    "sim",
]
# The sim engine: 512 blocks of 32 tokens (a pool the size of the tiny vLLM's order), 10x real time.
SIM_SETTINGS: dict[str, Any] = {"num_blocks": 512, "engine_args": ("--time-scale", "10")}

pytestmark = pytest.mark.timeout(600)  # the first test also waits for two engines to start

MAX_MODEL_LEN = 1024


class Pairs:
    def __init__(self, a: EnginePair, b: EnginePair) -> None:
        self.a = a
        self.b = b


@pytest_asyncio.fixture(scope="module", params=ENGINE_KINDS, loop_scope="module")
async def pairs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[Pairs]:
    work = tmp_path_factory.mktemp(f"llumlet-{request.param}")
    engine: dict[str, Any] = (SIM_SETTINGS if request.param == "sim"
                              else {"model_dir": request.getfixturevalue("tiny_model_dir")})
    configs = [
        PairConfig(instance_id="a", work_dir=work / "a", engine=request.param, max_model_len=MAX_MODEL_LEN,
                   shutdown_grace_s=20.0, **engine),
        PairConfig(instance_id="b", work_dir=work / "b", engine=request.param, max_model_len=MAX_MODEL_LEN,
                   max_num_seqs=2, shutdown_grace_s=20.0, **engine),
    ]
    started = [EnginePair(c) for c in configs]
    try:
        await asyncio.gather(*(p.start() for p in started))
        yield Pairs(*started)
    finally:
        await asyncio.gather(*(p.stop() for p in started), return_exceptions=True)


def _admission_watermark(pair: EnginePair) -> int:
    """The blocks an engine keeps free when admitting a prompt: the sim engine's (vLLM v0's 1%);
    vLLM keeps none unless started with `--watermark` (these engines are not)."""
    if pair.config.engine != "sim" or pair.config.num_blocks is None:
        return 0
    return EngineConfig(total_blocks=pair.config.num_blocks).watermark_blocks


def _body(pair: EnginePair, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": pair.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def _prompt(seed: int, length: int = 24) -> list[int]:
    return [(seed * 131 + i * 17) % 400 + 10 for i in range(length)]


async def _load(pair: EnginePair) -> pb.InstanceLoad:
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
        return await llumlet_pb2_grpc.LlumletStub(channel).GetLoad(pb.GetLoadRequest())


async def _health(pair: EnginePair) -> pb.HealthResponse:
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
        return await llumlet_pb2_grpc.LlumletStub(channel).Health(pb.HealthRequest(), timeout=5)


async def _engine_metrics(session: aiohttp.ClientSession, pair: EnginePair) -> Any:
    async with session.get(pair.engine_url + "/metrics") as response:
        return parse_engine_metrics(await response.text())


class RequestFailedError(Exception):
    """The request failed: an error status before the response began, or an error event mid-stream
    (which of the two depends on whether the engine had streamed anything yet)."""


async def _complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    endpoint: str = "/v1/completions") -> list[int]:
    """Token ids of the first choice, streaming or not (return_token_ids asked of both fronts)."""
    body = {**body, "return_token_ids": True}
    async with session.post(url + endpoint, json=body) as response:
        if response.status != 200:
            raise RequestFailedError((await response.json(content_type=None))["error"])
        if not body.get("stream"):
            return (await response.json())["choices"][0]["token_ids"]
        tokens: list[int] = []
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RequestFailedError(event["error"])
                for choice in event["choices"]:
                    tokens += choice.get("token_ids") or []
        return tokens


async def _generate(pair: EnginePair, body: dict[str, Any], request_id: str,
                    endpoint: int = pb.ENDPOINT_COMPLETION) -> list[int]:
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        tokens: list[int] = []
        async for event in stub.Generate(pb.GenerateRequest(request_id=request_id, endpoint=endpoint,
                                                            body_json=json.dumps(body))):
            tokens += event.chunk.token_ids
        return tokens


async def _wait_for_load(pair: EnginePair, condition: Callable[[pb.InstanceLoad], bool], timeout_s: float,
                         what: str, requests: Sequence[asyncio.Task[Any]] = ()) -> pb.InstanceLoad:
    """The first load of `pair` for which `condition` holds. Fails at once if one of `requests` ends
    first (with its error, if it failed), and on timeout with the last load seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = await _load(pair)
        if condition(load):
            return load
        for request in requests:
            if request.done():
                raise AssertionError(f"a request ended before {what}: {request.result()!r:.200}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what}; last load: source "
                f"{pb.LoadSource.Name(load.source)}, {len(load.running)} running, "
                f"{len(load.waiting)} waiting, {load.free_blocks}/{load.total_blocks} blocks free, "
                f"snapshot {load.snapshot_age_s:.1f} s old")
        await asyncio.sleep(0.05)


async def _wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.asyncio(loop_scope="module")
async def test_reported_blocks_match_the_engines_own_metrics(pairs: Pairs) -> None:
    async with aiohttp.ClientSession() as session:
        for pair in (pairs.a, pairs.b):
            # The engine's scrape is compared with the loads on both sides of it, while the request
            # still runs: a decoding request takes a block every 32 tokens, so on a loaded machine (a
            # scrape can take seconds beside a CPU hog) the scrape lies between the two loads' figures.
            # When the scrape, or even the first load listing the request, came after the engine
            # finished it, the attempt starts over.
            for attempt in range(5):
                body = _body(pair, _prompt(1 + attempt, 300), 700, stream=True)
                running = asyncio.create_task(_complete(session, pair.llumlet.http_url, body))
                load = await _wait_for_load(pair, lambda load, r=running: _running(load) or r.done(), 60,
                                            "a running request in the load")
                metrics = await _engine_metrics(session, pair)
                after = await _load(pair)
                running.cancel()  # the client goes away: the llumlet aborts the request on the engine
                (outcome,) = await asyncio.gather(running, return_exceptions=True)
                if isinstance(outcome, Exception):  # failed, rather than ended or cancelled
                    raise outcome
                await _wait_for_load(pair, _idle, 30, "the abandoned request to leave")
                if _running(load) and metrics.running == 1 and after.running:
                    break
            else:
                raise AssertionError("5 attempts: the request ended before every scrape")
            assert load.source == pb.LOAD_SOURCE_CONNECTOR
            # The load offers the blocks above the engine's admission watermark; its metrics count all.
            watermark = _admission_watermark(pair)
            assert abs(load.total_blocks + watermark - metrics.total_blocks) <= 1
            assert after.free_blocks - 1 <= metrics.free_blocks - watermark <= load.free_blocks + 1, \
                (load.free_blocks, after.free_blocks, metrics)
            assert load.block_size == metrics.block_size
            assert load.total_blocks - load.free_blocks >= blocks_for_tokens(300, load.block_size)


def _running(load: pb.InstanceLoad) -> bool:
    return bool(load.running) and load.running[0].output_tokens > 0


@pytest.mark.asyncio(loop_scope="module")
async def test_freeness_falls_with_admitted_requests_and_recovers_when_they_finish(pairs: Pairs) -> None:
    pair = pairs.a
    idle = await _wait_for_load(pair, _idle, 30, "an idle instance")
    async with aiohttp.ClientSession() as session:
        # 200 + 800 of 1024 positions: the four are still running together when the last one starts,
        # however slowly a loaded machine admits them.
        requests = [asyncio.create_task(_complete(session, pair.llumlet.http_url,
                                                  _body(pair, _prompt(i, 200), 800, stream=True)))
                    for i in range(4)]
        busy = await _wait_for_load(pair, lambda load: len(load.running) == 4, 180, "four running requests",
                                    requests)
        assert busy.freeness < idle.freeness
        assert busy.free_blocks < idle.free_blocks
        assert {r.request_id for r in busy.running} == {r.request_id for r in busy.running
                                                        if r.request_id.startswith("llumlet-")}
        await asyncio.gather(*requests)
    after = await _wait_for_load(pair, _idle, 30, "the instance to be idle again")
    assert after.freeness == pytest.approx(idle.freeness)
    assert after.free_blocks == idle.free_blocks


def _idle(load: pb.InstanceLoad) -> bool:
    return bool(load.total_blocks) and not load.running and not load.waiting


@pytest.mark.asyncio(loop_scope="module")
async def test_queued_requests_raise_virtual_usage_before_they_are_scheduled(pairs: Pairs) -> None:
    pair = pairs.b  # at most two running: the others queue
    async with aiohttp.ClientSession() as session:
        # 160 + 800 of 1024 positions: the first two still run when the last two arrive.
        requests = [asyncio.create_task(_complete(session, pair.llumlet.http_url,
                                                  _body(pair, _prompt(50 + i, 160), 800, stream=True)))
                    for i in range(4)]
        queued = await _wait_for_load(  # 60 s ran out beside a CPU-bound CI run
            pair, lambda load: len(load.running) == 2 and bool(load.waiting), 180,
            "two running and some queued requests", requests)
        used = queued.total_blocks - queued.free_blocks
        head_of_line = blocks_for_tokens(queued.waiting[0].prompt_tokens, queued.block_size)
        assert queued.waiting[0].blocks == 0
        assert queued.virtual_usage == used + head_of_line
        assert queued.virtual_usage > used
        assert queued.freeness == pytest.approx((queued.total_blocks - used - head_of_line) / 3)
        await asyncio.gather(*requests)


@pytest.mark.asyncio(loop_scope="module")
async def test_concurrent_greedy_requests_return_the_engines_own_tokens(pairs: Pairs) -> None:
    pair = pairs.a
    bodies = [_body(pair, _prompt(100 + i, 16 + i), 24) for i in range(20)]
    chat = {"model": pair.served_model_name, "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        direct = await asyncio.gather(*(_complete(session, pair.engine_url, b) for b in bodies))
        direct_chat = await _complete(session, pair.engine_url, chat, "/v1/chat/completions")
        via_http = await asyncio.gather(*(
            _complete(session, pair.llumlet.http_url, {**b, "stream": i % 2 == 0})
            for i, b in enumerate(bodies)))
        via_chat = await _complete(session, pair.llumlet.http_url, {**chat, "stream": True},
                                   "/v1/chat/completions")
    via_grpc = await asyncio.gather(*(_generate(pair, b, f"grpc-{i}") for i, b in enumerate(bodies)))
    grpc_chat = await _generate(pair, chat, "grpc-chat", pb.ENDPOINT_CHAT)
    assert all(len(tokens) == 24 for tokens in direct)
    assert via_http == direct
    assert via_grpc == direct
    assert via_chat == direct_chat == grpc_chat


@pytest.mark.asyncio(loop_scope="module")
async def test_malformed_requests_get_openai_errors_and_the_llumlet_survives(pairs: Pairs) -> None:
    pair = pairs.a
    url = pair.llumlet.http_url
    cases: list[tuple[str, bytes]] = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", json.dumps({"model": pair.served_model_name}).encode()),
        ("/v1/completions", json.dumps(_body(pair, [1, 2], -5)).encode()),
        ("/v1/completions", json.dumps({**_body(pair, [1, 2], 5), "model": "no-such-model"}).encode()),
        ("/v1/completions", json.dumps(_body(pair, [1] * (MAX_MODEL_LEN + 10), 5)).encode()),
        ("/v1/chat/completions", json.dumps({"model": pair.served_model_name, "messages": "hi"}).encode()),
        ("/v1/completions", json.dumps({**_body(pair, [1, 2], 5), "stream": "maybe"}).encode()),
        ("/v1/completions", json.dumps({**_body(pair, [1, 2], 5),
                                        "stream_options": {"include_usage": True}}).encode()),
    ]
    async with aiohttp.ClientSession() as session:
        for path, payload in cases:
            async with session.post(url + path, data=payload,
                                    headers={"Content-Type": "application/json"}) as response:
                body = await response.json()
                assert 400 <= response.status < 500, (payload, response.status, body)
                assert body["error"]["code"] == response.status
                assert body["error"]["message"]
        async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
            stub = llumlet_pb2_grpc.LlumletStub(channel)
            for request in (pb.GenerateRequest(request_id="bad-1", endpoint=pb.ENDPOINT_COMPLETION,
                                               body_json="{"),
                            pb.GenerateRequest(request_id="bad-2", body_json="{}"),
                            pb.GenerateRequest(request_id="bad-3", endpoint=pb.ENDPOINT_COMPLETION,
                                               body_json=json.dumps(_body(pair, [1, 2], -5)))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(request):
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert json.loads(info.value.details())["error"]["code"] == 400
        assert len(await _complete(session, url, _body(pair, [5, 6, 7], 4))) == 4
    assert (await _health(pair)).status == pb.HEALTH_STATUS_SERVING


@pytest.mark.asyncio(loop_scope="module")
async def test_stream_fields_are_read_as_the_engine_reads_them(pairs: Pairs) -> None:
    """vLLM reads booleans laxly: "false" does not stream, "TRUE" and 1 do."""
    pair = pairs.a
    body = _body(pair, [3, 4, 5], 6)
    async with aiohttp.ClientSession() as session:
        for stream, streams in (("false", False), (0, False), ("TRUE", True), (1, True)):
            async with session.post(pair.llumlet.http_url + "/v1/completions",
                                    json={**body, "stream": stream}) as response:
                assert response.status == 200, await response.text()
                kind = response.headers["Content-Type"].split(";")[0]
                assert kind == ("text/event-stream" if streams else "application/json"), stream
                await response.read()


@pytest.mark.asyncio(loop_scope="module")
async def test_watch_load_pushes_changes_at_a_bounded_rate(pairs: Pairs) -> None:
    pair = pairs.a
    received: list[tuple[float, pb.InstanceLoad]] = []
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel, \
            aiohttp.ClientSession() as session:
        stream = llumlet_pb2_grpc.LlumletStub(channel).WatchLoad(pb.WatchLoadRequest())

        async def collect() -> None:
            async for load in stream:
                received.append((time.monotonic(), load))

        collector = asyncio.create_task(collect())
        await wait_until(lambda: bool(received), "the stream's first load")
        # The windows are measured, not assumed: a loaded machine wakes the test late from a sleep.
        idle_from = time.monotonic()
        await asyncio.sleep(1.5)  # idle: heartbeats only
        idle_count = len(received)
        idle_s = time.monotonic() - idle_from
        busy_from = time.monotonic()
        await _complete(session, pair.llumlet.http_url, _body(pair, _prompt(7, 64), 80))
        await asyncio.sleep(0.3)
        busy_s = time.monotonic() - busy_from
        stream.cancel()
        await asyncio.gather(collector, return_exceptions=True)
    # A heartbeat at least every second, nothing more while idle: the first load and one a second
    # (3 in a 1.5 s window).
    assert 1 <= idle_count <= 2 + int(idle_s)
    busy = [load for t, load in received if t >= busy_from]
    assert any(load.running for load in busy)
    assert len(busy) <= busy_s / 0.05 + 2  # at most one push per 50 ms however fast it steps
    sequences = [load.sequence for _, load in received]
    assert sequences == sorted(sequences)


@pytest.mark.asyncio(loop_scope="module")
async def test_draining_refuses_requests_and_reports_infinite_usage(pairs: Pairs) -> None:
    pair = pairs.a
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel, \
            aiohttp.ClientSession() as session:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        assert (await stub.SetDraining(pb.SetDrainingRequest(draining=True))).draining
        try:
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.draining and load.virtual_usage == math.inf and load.freeness == -math.inf
            async with session.post(pair.llumlet.http_url + "/v1/completions",
                                    json=_body(pair, [1, 2, 3], 4)) as response:
                assert response.status == 503
                assert "draining" in (await response.json())["error"]["message"]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(pb.GenerateRequest(
                        request_id="drained", endpoint=pb.ENDPOINT_COMPLETION,
                        body_json=json.dumps(_body(pair, [1, 2, 3], 4)))):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await stub.SetDraining(pb.SetDrainingRequest(draining=False))
        assert len(await _complete(session, pair.llumlet.http_url, _body(pair, [1, 2, 3], 4))) == 4


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_ends_a_running_generate(pairs: Pairs) -> None:
    pair = pairs.a
    body = _body(pair, _prompt(9, 32), 800)
    async with grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        tokens = 0
        finish = ""
        async for event in stub.Generate(pb.GenerateRequest(request_id="to-abort",
                                                             endpoint=pb.ENDPOINT_COMPLETION,
                                                             body_json=json.dumps(body))):
            tokens += len(event.chunk.token_ids)
            if tokens >= 5 and not finish:
                assert (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).aborted
                finish = "asked"
            if event.chunk.finish_reason:
                finish = event.chunk.finish_reason
        assert finish == "abort"
        assert tokens < 800
        assert not (await stub.Abort(pb.AbortRequest(request_id="to-abort"))).aborted
    await _wait_for_load(pair, _idle, 30, "the aborted request to leave the engine")


@pytest.mark.asyncio(loop_scope="module")
async def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(pairs: Pairs) -> None:
    pair = pairs.a
    # In flight until the test has seen the llumlet drain and refuse a request (once it ends, the
    # llumlet stops its servers): 80 tokens ended 0.2-0.3 s after the first on either engine. Well
    # within the 20 s shutdown grace even on a loaded machine.
    tokens = 600
    async with aiohttp.ClientSession() as session:
        running = asyncio.create_task(_complete(session, pair.llumlet.http_url,
                                                _body(pair, _prompt(3, 32), tokens, stream=True)))
        await _wait_for_load(pair, _running, 30, "the request to run")
        pair.llumlet.signal(signal.SIGTERM)
        # Shutting down, it reports itself draining: from then on it refuses new requests.
        await _wait_for_load(pair, lambda load: load.draining, 30, "the llumlet to drain")
        async with session.post(pair.llumlet.http_url + "/v1/completions",
                                json=_body(pair, [1, 2, 3], 4)) as response:
            assert response.status == 503
        assert len(await running) == tokens
    assert await pair.llumlet.stop(timeout_s=10) == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_engine_death_makes_the_llumlet_unhealthy_and_fails_in_flight_requests(pairs: Pairs) -> None:
    pair = pairs.b
    async with aiohttp.ClientSession() as session:
        http_request = asyncio.create_task(_complete(session, pair.llumlet.http_url,
                                                     _body(pair, _prompt(4, 32), 900, stream=True)))
        grpc_request = asyncio.create_task(_generate(pair, _body(pair, _prompt(5, 32), 900), "doomed"))
        await _wait_for_load(pair, lambda load: len(load.running) == 2, 30, "both requests to run",
                             [http_request, grpc_request])
        killed_at = time.monotonic()
        pair.kill_engine()
        with pytest.raises(RequestFailedError) as failed:
            await http_request
        assert failed.value.args[0]["type"] == "EngineUnavailable"
        assert failed.value.args[0]["code"] in (502, 503)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await grpc_request
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine" in json.loads(info.value.details())["error"]["message"]
        health = await _wait_for(lambda: _unhealthy(pair), 10, "the llumlet to report the engine down")
        assert time.monotonic() - killed_at < 5
        assert not health.engine_healthy
        async with session.get(pair.llumlet.http_url + "/health") as response:
            assert response.status == 503
        async with session.post(pair.llumlet.http_url + "/v1/completions",
                                json=_body(pair, [1, 2, 3], 4)) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == 503


async def _unhealthy(pair: EnginePair) -> pb.HealthResponse | None:
    health = await _health(pair)
    return health if health.status == pb.HEALTH_STATUS_NOT_SERVING else None
