"""The llumlet process in-process, without an engine: snapshots published on its channel come out of
the gRPC API as loads; draining, health and admission behave as documented while no engine answers."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from waiting import wait_until_async

from llumlet.server import Llumlet, LlumletConfig
from llumnix.engine.snapshots import SNAPSHOT_SCHEMA_VERSION, SnapshotPublisher
from llumnix.launch.pair import free_port
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot


@pytest_asyncio.fixture
async def llumlet(tmp_path: Path) -> AsyncIterator[tuple[Llumlet, SnapshotPublisher]]:
    addr = f"ipc://{tmp_path / 'snap.sock'}"
    publisher = SnapshotPublisher(addr)
    # Nothing listens on the engine port: the engine counts as down.
    server = Llumlet(LlumletConfig(instance_id="u", engine_url=f"http://127.0.0.1:{free_port()}",
                                   snapshot_addr=addr, host="127.0.0.1", http_port=0, grpc_port=0,
                                   engine_check_interval_s=0.05, shutdown_grace_s=1.0))
    await server.start()
    try:
        yield server, publisher
    finally:
        await server.shutdown()
        publisher.close()


def _snapshot(step: int, free: int) -> EngineSnapshot:
    return EngineSnapshot(schema_version=SNAPSHOT_SCHEMA_VERSION, engine_id="e", step=step,
                          timestamp=time.time(), total_blocks=100, free_blocks=free, block_size=16,
                          running=[EngineRequest(request_id="r1", prompt_tokens=40, output_tokens=3,
                                                 blocks=3)],
                          waiting=[EngineRequest(request_id="r2", prompt_tokens=50)])


async def _publish_until_seen(stub: llumlet_pb2_grpc.LlumletStub, publisher: SnapshotPublisher,
                              free: int) -> pb.InstanceLoad:
    # ZeroMQ drops what is published before the subscription is in place: repeat until it lands.
    steps = itertools.count(1)

    async def landed() -> pb.InstanceLoad | None:
        publisher.publish(_snapshot(next(steps), free))
        load = await stub.GetLoad(pb.GetLoadRequest())
        return load if load.free_blocks == free else None

    return await wait_until_async(landed, "the snapshot to reach the llumlet")


async def test_snapshots_become_loads_with_the_load_models_numbers(llumlet: tuple) -> None:
    server, publisher = llumlet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        load = await _publish_until_seen(stub, publisher, free=90)
        assert load.source == pb.LOAD_SOURCE_CONNECTOR
        assert [r.request_id for r in load.running] == ["r1"]
        assert [r.request_id for r in load.waiting] == ["r2"]
        assert load.virtual_usage == 10 + 4  # used blocks + the head of line's 50 tokens in 16-token blocks
        assert load.freeness == pytest.approx((100 - 14) / 2)
        assert 0 <= load.snapshot_age_s < 5

        watch = stub.WatchLoad(pb.WatchLoadRequest(min_interval_ms=5))
        first = await anext(aiter(watch))
        publisher.publish(_snapshot(500, 70))
        changed = await asyncio.wait_for(anext(aiter(watch)), 2.0)
        assert (first.free_blocks, changed.free_blocks) == (90, 70)
        assert changed.sequence > first.sequence

        drained = await stub.SetDraining(pb.SetDrainingRequest(draining=True))
        assert drained.draining
        pushed = await asyncio.wait_for(anext(aiter(watch)), 2.0)
        assert pushed.draining and pushed.virtual_usage == math.inf and pushed.freeness == -math.inf
        watch.cancel()


async def test_without_an_engine_requests_are_refused_and_health_says_why(llumlet: tuple) -> None:
    server, _ = llumlet
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        health = await stub.Health(pb.HealthRequest())
        assert health.status == pb.HEALTH_STATUS_NOT_SERVING and not health.engine_healthy
        assert "engine" in health.message
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(pb.GenerateRequest(
                    request_id="x", endpoint=pb.ENDPOINT_COMPLETION,
                    body_json=json.dumps({"model": "m", "prompt": "hi"}))):
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert json.loads(info.value.details())["error"]["code"] == 503
        assert not (await stub.Abort(pb.AbortRequest(request_id="x"))).aborted
    base = f"http://127.0.0.1:{server.http_port}"
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["type"] == "EngineUnavailable"
        async with session.post(base + "/v1/completions", data=b"{") as response:
            assert response.status == 400
        async with session.get(base + "/health") as response:
            assert response.status == 503
            assert (await response.json())["status"] == "not-serving"
        async with session.get(base + "/v1/models") as response:
            assert response.status == 502
        async with session.get(base + "/metrics") as response:
            text = await response.text()
            assert "llumnix_llumlet_refused_requests_total 2.0" in text
