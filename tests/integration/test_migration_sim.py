"""Live migration between sim engine + llumlet pairs (processes): the protocol, its failure paths
and stream continuity, on the same engine channel and KV transport vLLM uses."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from serve_adapter import serve_from_generate
from service_auth import authenticated_channel
from waiting import wait_until

from llumlet.migration.downtime import DOWNTIME_PARTS
from llumnix.launch.pair import EnginePair
from llumnix.router.api import ApiSettings
from llumnix.router.generation import GenerationLimits
from llumnix.router.server import Router
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

pytestmark = pytest.mark.asyncio(loop_scope="module")

StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]
SIM_MODEL = "sim"

# Fast steps (a decode step of a few ms), so a long request runs a few seconds.
SIM_ARGS = ("--time-scale", "4")
STAGING_FOREVER = ("--migration-max-stages", "1000", "--migration-final-delta-blocks", "0")


def _body(prompt_seed: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": SIM_MODEL, "prompt": [(prompt_seed * 7 + i) % 1000 + 1 for i in range(40)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}


@dataclass
class Stream:
    """One Generate call (or attach) read to its end in the background."""

    tokens: list[int] = field(default_factory=list)
    moved: pb.Moved | None = None
    finish_reason: str = ""
    error: grpc.aio.AioRpcError | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self, call: AsyncIterator[pb.GenerateResponse]) -> Stream:
        try:
            async for message in call:
                if message.HasField("moved"):
                    self.moved = message.moved
                    continue
                self.tokens += message.chunk.token_ids
                self.finish_reason = message.chunk.finish_reason or self.finish_reason
                if self.tokens:
                    self.first_token.set()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        self.first_token.set()
        return self


class Llumlet:
    """gRPC stubs of one pair's llumlet."""

    def __init__(self, pair: EnginePair) -> None:
        self.pair = pair
        self.channel = authenticated_channel(pair.grpc_address)
        self.api = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.migration = migration_pb2_grpc.LlumletMigrationStub(self.channel)

    def generate(self, request_id: str, body: dict[str, Any]) -> tuple[Stream, asyncio.Task[Stream]]:
        stream = Stream()
        call = self.api.Generate(pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                                                    body_json=json.dumps(body)))
        return stream, asyncio.create_task(stream.read(call))

    def attach(self, request_id: str) -> tuple[Stream, asyncio.Task[Stream]]:
        stream = Stream()
        call = self.api.Generate(pb.GenerateRequest(request_id=request_id, attach=True))
        return stream, asyncio.create_task(stream.read(call))

    async def migrate_out(self, destination: Llumlet, request_id: str = "") -> mpb.MigrateOutResponse:
        return await self.migration.MigrateOut(mpb.MigrateOutRequest(
            destination_instance_id=destination.pair.config.instance_id,
            destination_address=destination.pair.grpc_address, request_id=request_id), timeout=60)

    async def wait_load(self, condition: Callable[[pb.InstanceLoad], bool], what: str,
                        timeout_s: float = 10.0) -> pb.InstanceLoad:
        """The first load this llumlet reports for which `condition` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = await self.api.GetLoad(pb.GetLoadRequest())
            if condition(load):
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {timeout_s} s: {load}")
            await asyncio.sleep(0.02)

    async def wait_idle(self, timeout_s: float = 10.0) -> pb.InstanceLoad:
        """The load once no request runs and no migration holds anything here."""
        return await self.wait_load(
            lambda load: (not load.running and not load.waiting and load.reserved_blocks == 0
                          and load.migrating_in == 0 and load.migrating_out == 0
                          and load.free_blocks == load.total_blocks), "idle", timeout_s)


@dataclass
class Cluster:
    a: Llumlet
    b: Llumlet
    small: Llumlet
    """Room for little (refuses large migrations)."""
    short: Llumlet
    """Room for much but a context too short for a resumed long request (the handshake does not
    compare context lengths: such commits fail). Its room does not depend on how far the request got
    by its Propose, as the small instance's would (it refuses from 57 generated tokens on)."""
    stager: Llumlet
    """Stages until the request finishes (no final stage by delta)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(sim_pairs: StartPairs) -> AsyncIterator[Cluster]:
    common: dict[str, Any] = {"engine_args": SIM_ARGS, "block_size": 16, "max_model_len": 2048,
                              "num_blocks": 1000}
    a, b = await sim_pairs(2, "mig", **common)
    (small,) = await sim_pairs(1, "small", **{**common, "num_blocks": 16, "max_model_len": 60})
    (short,) = await sim_pairs(1, "short", **{**common, "max_model_len": 60})
    (stager,) = await sim_pairs(1, "stager", **common, llumlet_args=STAGING_FOREVER)
    nodes = Cluster(*(Llumlet(p) for p in (a, b, small, short, stager)))
    yield nodes
    for node in (nodes.a, nodes.b, nodes.small, nodes.short, nodes.stager):
        await node.channel.close()


async def _reference(node: Llumlet, body: dict[str, Any], request_id: str) -> list[int]:
    stream, task = node.generate(request_id, body)
    await task
    assert stream.error is None and stream.moved is None
    return stream.tokens


async def _after_tokens(stream: Stream, count: int) -> None:
    await wait_until(lambda: len(stream.tokens) >= count or stream.error is not None or stream.finish_reason,
                     f"{count} tokens streamed", timeout_s=60)
    assert len(stream.tokens) >= count, f"the request ended too early: {stream.error or stream.finish_reason}"


async def _downtime_parts_observed(node: Llumlet) -> dict[str, tuple[float, float]]:
    """Observations and seconds per part in the llumlet's histogram of the downtime's parts."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"{node.pair.llumlet.http_url}/metrics") as response:
        text = await response.text()
    samples = {(sample.name, sample.labels.get("part")): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name.startswith("llumnix_llumlet_migration_downtime_part_seconds")}
    name = "llumnix_llumlet_migration_downtime_part_seconds"
    return {part: (samples[(f"{name}_count", part)], samples[(f"{name}_sum", part)])
            for part in DOWNTIME_PARTS}


async def test_migrated_request_continues_at_the_destination_with_the_same_tokens(cluster: Cluster) -> None:
    body = _body(1, 300)
    expected = await _reference(cluster.b, body, "ref-1")
    stream, task = cluster.a.generate("m-1", body)
    await _after_tokens(stream, 20)
    before = await _downtime_parts_observed(cluster.a)
    result = await cluster.a.migrate_out(cluster.b, "m-1")
    assert result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED, result.reason
    assert result.stages >= 2 and result.bytes > 0 and result.migrated_tokens > 40
    assert 0 < result.downtime_ms < result.duration_ms
    # The downtime's parts lie inside it, the destination's share inside Commit's round trip.
    assert result.final_stage_ms > 0 and 0 < result.destination_first_token_ms < result.commit_ms
    assert result.final_stage_ms + result.commit_ms <= result.downtime_ms
    assert 0 < result.final_stage_kv_ms + result.final_stage_event_ms <= result.final_stage_ms
    assert result.destination_admitted_ms + result.destination_kv_load_ms <= result.destination_first_token_ms
    # The source's histogram of the parts: one more observation each, adding up to the answer's.
    after = await _downtime_parts_observed(cluster.a)
    observed = {part: count - before[part][0] for part, (count, _) in after.items()}
    assert observed == dict.fromkeys(DOWNTIME_PARTS, 1)
    assert sum(total - before[part][1] for part, (_, total) in after.items()) == pytest.approx(
        (result.final_stage_ms + result.commit_ms) / 1e3, abs=1e-6)
    await task
    assert stream.moved is not None and stream.moved.address == cluster.b.pair.grpc_address
    assert stream.moved.request_id == "m-1" and stream.moved.migration_id == result.migration_id
    rest, rest_task = cluster.b.attach("m-1")
    await rest_task
    assert rest.error is None and rest.finish_reason == "length"
    assert stream.tokens + rest.tokens == expected
    await cluster.a.wait_idle()
    await cluster.b.wait_idle()


async def test_a_request_migrates_there_and_back(cluster: Cluster) -> None:
    body = _body(2, 400)
    expected = await _reference(cluster.a, body, "ref-2")
    first, task = cluster.a.generate("m-2", body)
    await _after_tokens(first, 10)
    assert (await cluster.a.migrate_out(cluster.b, "m-2")).outcome == mpb.MIGRATION_OUTCOME_COMMITTED
    await task
    second, second_task = cluster.b.attach("m-2")
    await _after_tokens(second, 10)
    back = await cluster.b.migrate_out(cluster.a)  # chosen by the llumlet (the only request)
    assert back.outcome == mpb.MIGRATION_OUTCOME_COMMITTED, back.reason
    assert back.request_id == "m-2"
    await second_task
    assert second.moved is not None and second.moved.address == cluster.a.pair.grpc_address
    third, third_task = cluster.a.attach("m-2")
    await third_task
    assert first.tokens + second.tokens + third.tokens == expected
    await cluster.a.wait_idle()
    await cluster.b.wait_idle()


async def test_refusals_leave_the_request_untouched(cluster: Cluster) -> None:
    body = _body(3, 600)
    expected = await _reference(cluster.b, body, "ref-3")
    stream, task = cluster.a.generate("m-3", body)
    await _after_tokens(stream, 200)  # 240 tokens = 15 blocks, more than the small instance admits
    refused = await cluster.a.migrate_out(cluster.small, "m-3")
    assert refused.outcome == mpb.MIGRATION_OUTCOME_REFUSED and "room" in refused.reason
    unknown = await cluster.a.migrate_out(cluster.b, "nobody")
    assert unknown.outcome == mpb.MIGRATION_OUTCOME_NO_CANDIDATE
    await task
    assert stream.moved is None and stream.tokens == expected
    await cluster.small.wait_idle()
    await cluster.a.wait_idle()


async def test_requests_whose_state_cannot_move_are_not_candidates(cluster: Cluster) -> None:
    stream, task = cluster.a.generate("m-4", _body(4, 200, stop=["never-in-output"]))
    await _after_tokens(stream, 5)
    named = await cluster.a.migrate_out(cluster.b, "m-4")
    assert named.outcome == mpb.MIGRATION_OUTCOME_NO_CANDIDATE and "stop strings" in named.reason
    chosen = await cluster.a.migrate_out(cluster.b)
    assert chosen.outcome == mpb.MIGRATION_OUTCOME_NO_CANDIDATE
    await task
    assert stream.moved is None and len(stream.tokens) == 200


async def test_concurrent_migrations_are_bounded(cluster: Cluster) -> None:
    # On the stager a migration stages until its request ends, so the first is still in flight when the
    # second asks, however fast or slowly the two arrive (on a plain instance a migration takes two
    # engine steps). 600 tokens: about 4 s, under the stager's 1000 stages at one per step.
    streams = [cluster.stager.generate(f"m-5-{i}", _body(5 + i, 600)) for i in range(2)]
    for stream, _ in streams:
        await _after_tokens(stream, 20)
    first = asyncio.create_task(cluster.stager.migrate_out(cluster.b, "m-5-0"))
    await cluster.stager.wait_load(lambda load: load.migrating_out == 1, "the first migration in flight")
    second = await cluster.stager.migrate_out(cluster.b, "m-5-1")
    assert second.outcome == mpb.MIGRATION_OUTCOME_BUSY, second
    assert (await first).outcome == mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE
    for stream, task in streams:
        await task
        assert stream.moved is None and len(stream.tokens) == 600
    await cluster.stager.wait_idle()
    await cluster.b.wait_idle()


async def test_request_finishing_during_its_migration_stays_on_the_source(cluster: Cluster) -> None:
    # Long enough to be running when MigrateOut reaches the stager however slowly the test gets there
    # (60 tokens ended about 0.35 s after its 5th); short enough that the stager's stages (one per
    # engine step at most) stay below its 1000 until the request finishes.
    stream, task = cluster.stager.generate("m-6", _body(6, 400))
    await _after_tokens(stream, 5)
    result = await cluster.stager.migrate_out(cluster.b, "m-6")
    assert result.outcome == mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE, result.reason
    await task
    assert stream.moved is None and len(stream.tokens) == 400
    await cluster.b.wait_idle()  # the reservation was released
    await cluster.stager.wait_idle()


@pytest.mark.parametrize("dies", ["engine", "llumlet"])
async def test_destination_dying_mid_stage_aborts_and_the_source_continues(
        cluster: Cluster, sim_pairs: StartPairs, dies: str) -> None:
    (doomed_pair,) = await sim_pairs(1, "doomed", engine_args=SIM_ARGS, block_size=16, max_model_len=2048,
                                     num_blocks=1000)
    doomed = Llumlet(doomed_pair)
    body = _body(7, 500)
    expected = await _reference(cluster.b, body, "ref-7")
    stream, task = cluster.stager.generate("m-7", body)
    await _after_tokens(stream, 10)
    migration = asyncio.create_task(cluster.stager.migrate_out(doomed, "m-7"))
    await doomed.wait_load(lambda load: load.migrating_in == 1 and load.reserved_blocks > 0, "staging")
    if dies == "engine":
        doomed_pair.kill_engine()
    else:  # its engine keeps taking stages; the source learns it from the dropped connection
        doomed_pair.llumlet.signal(signal.SIGKILL)
    result = await migration
    assert result.outcome == mpb.MIGRATION_OUTCOME_ABORTED, result
    await task
    assert stream.moved is None and stream.tokens == expected
    await cluster.stager.wait_idle()
    await doomed.channel.close()


async def test_failure_after_the_final_stage_resumes_on_the_source(cluster: Cluster) -> None:
    body = _body(8, 500)  # outlives its whole migration (200 ended about 1 s after its 30th token)
    expected = await _reference(cluster.b, body, "ref-8")
    stream, task = cluster.a.generate("m-8", body)
    await _after_tokens(stream, 30)  # 70 tokens: more than the short engine's context
    result = await cluster.a.migrate_out(cluster.short, "m-8")
    assert result.outcome == mpb.MIGRATION_OUTCOME_RESUMED_ON_SOURCE, result
    await task
    assert stream.moved is None and stream.error is None and stream.tokens == expected
    await cluster.short.wait_idle()
    await cluster.a.wait_idle()


async def test_router_follows_a_migrated_stream_by_attaching(cluster: Cluster,
                                                             start_router: StartRouter) -> None:
    body = _body(9, 300)
    expected = await _reference(cluster.b, body, "ref-9")
    router = await start_router([cluster.a.pair.grpc_address, cluster.b.pair.grpc_address])
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    tokens: list[int] = []
    migrated: list[mpb.MigrateOutResponse] = []
    by_address = {node.pair.grpc_address: node for node in (cluster.a, cluster.b)}

    async def migrate_once() -> None:
        await wait_until(lambda: len(tokens) >= 20, "20 tokens streamed through the router", timeout_s=60)
        # From where the router placed it (a tie or a load not yet updated after the reference run
        # decides which), to the other: trying A -> B, then B -> A moved a request placed on A twice.
        (serving,) = (i for i in router.instances.all() if i.in_flight)
        source = by_address[serving.address]
        migrated.append(await source.migrate_out(cluster.b if source is cluster.a else cluster.a))

    mover = asyncio.create_task(migrate_once())
    async with aiohttp.ClientSession() as session, \
            session.post(url, json={**body, "stream": True, "return_token_ids": True}) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
    await mover
    assert [r.outcome for r in migrated] == [mpb.MIGRATION_OUTCOME_COMMITTED], migrated
    assert tokens == expected
    assert router.metrics.moves._value.get() == 1
    assert router.metrics.replays._value.get() == 0


async def test_a_request_moved_more_often_than_the_router_retries_still_finishes(
        cluster: Cluster, start_router: StartRouter) -> None:
    """Moves are not failures: a router that sends a request to at most 2 instances follows it through
    3 live migrations (the accelerated soak lost a request on its 4th move at the default of 4)."""
    body = _body(11, 1900)  # outlives its moves by far on a slow machine
    expected = await _reference(cluster.b, body, "ref-11")
    api = ApiSettings(model=SIM_MODEL, generation=GenerationLimits(max_attempts=2))
    router = await start_router([cluster.a.pair.grpc_address, cluster.b.pair.grpc_address], api=api)
    tokens: list[int] = []

    by_address = {node.pair.grpc_address: node for node in (cluster.a, cluster.b)}

    async def ping_pong() -> list[str]:
        request_ids = []
        for hop in range(3):
            wanted = 10 * (hop + 1)
            await wait_until(lambda wanted=wanted: len(tokens) >= wanted, f"{wanted} tokens streamed")
            (serving,) = (i for i in router.instances.all() if i.in_flight)
            source = by_address[serving.address]
            destination = cluster.b if source is cluster.a else cluster.a
            result = await source.migrate_out(destination)  # the only request there
            assert result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED, (hop, result)
            request_ids.append(result.request_id)
        return request_ids

    async with aiohttp.ClientSession() as session:
        moves = asyncio.create_task(ping_pong())
        async with session.post(f"http://127.0.0.1:{router.port}/v1/completions",
                                json={**body, "stream": True, "return_token_ids": True}) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        tokens.extend(choice.get("token_ids") or [])
    assert len(set(await moves)) == 1
    assert tokens == expected
    assert router.metrics.moves._value.get() == 3
    assert router.metrics.replays._value.get() == 0
    await cluster.a.wait_idle()
    await cluster.b.wait_idle()


class LostMoveLlumlet(llumlet_pb2_grpc.LlumletServicer):
    """Serves the first tokens of its first request from a real llumlet, then says the request moved
    to a destination that does not have it (as after a destination restart); later requests are
    served by the destination whole."""

    def __init__(self, upstream: str, destination: str, tokens_before_move: int) -> None:
        self.upstream = upstream
        self.destination = destination
        self.tokens_before_move = tokens_before_move
        self.calls = 0

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.InstanceLoad]:
        sequence = 0
        while True:
            sequence += 1
            yield pb.InstanceLoad(instance_id="lost-mover", total_blocks=1000, free_blocks=1000,
                                  block_size=16, sequence=sequence, timestamp=float(sequence),
                                  source=pb.LOAD_SOURCE_CONNECTOR)
            await asyncio.sleep(0.2)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        first = self.calls == 1
        async with authenticated_channel(self.upstream if first else self.destination) as channel:
            call = llumlet_pb2_grpc.LlumletStub(channel).Generate(request)
            sent = 0
            async for message in call:
                yield message
                sent += len(message.chunk.token_ids)
                if first and sent >= self.tokens_before_move:
                    call.cancel()
                    break
        if first:
            yield pb.GenerateResponse(moved=pb.Moved(instance_id="b", address=self.destination,
                                                     request_id="not-there", migration_id="lost"))

    async def Serve(self, request_iterator: AsyncIterator[pb.ServeCommand],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServeEvents]:
        async for events in serve_from_generate(request_iterator, lambda r: self.Generate(r, context)):
            yield events


async def test_router_falls_back_to_token_replay_when_attaching_fails(cluster: Cluster,
                                                                      start_router: StartRouter) -> None:
    body = _body(10, 80)
    expected = await _reference(cluster.b, body, "ref-10")
    server = grpc.aio.server()
    llumlet_pb2_grpc.add_LlumletServicer_to_server(
        LostMoveLlumlet(cluster.a.pair.grpc_address, cluster.b.pair.grpc_address, 20), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        router = await start_router([f"127.0.0.1:{port}"])
        tokens: list[int] = []
        async with aiohttp.ClientSession() as session, session.post(
                f"http://127.0.0.1:{router.port}/v1/completions",
                json={**body, "stream": True, "return_token_ids": True}) as response:
            async for line in response.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        tokens.extend(choice.get("token_ids") or [])
        assert tokens == expected
        assert router.metrics.moves._value.get() == 1
        assert router.metrics.replays._value.get() == 1
    finally:
        await server.stop(grace=None)
