"""A llumlet process started with the service token lets in only callers that present it: a request
sent straight to its HTTP port or its gRPC port without it (or with a wrong one) is refused, the same
request with it is served, and the token is nowhere on the llumlet's command line."""

from __future__ import annotations

import json

import aiohttp
import grpc
import psutil
import pytest
import pytest_asyncio
from conftest import SIM_MODEL, StartPairs
from service_auth import SERVICE_TOKEN, authenticated_channel

from llumnix.launch.pair import EnginePair
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

BODY = {"model": SIM_MODEL, "prompt": "hello there", "max_tokens": 4}

pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                              body_json=json.dumps(BODY))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(sim_pairs: StartPairs) -> EnginePair:
    (pair,) = await sim_pairs(1, "auth", engine_args=("--time-scale", "50"))
    return pair


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
async def test_http_without_the_token_is_refused(pair: EnginePair, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session, \
            session.post(pair.llumlet.http_url + "/v1/completions", json=BODY, headers=headers) as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_api_key"


async def test_http_with_the_token_is_served_and_probes_need_none(pair: EnginePair) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(pair.llumlet.http_url + "/v1/completions", json=BODY,
                                headers={"Authorization": SERVICE_TOKEN.authorization}) as response:
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 4
        async with session.get(pair.llumlet.http_url + "/health") as response:
            assert response.status == 200


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)], ids=["missing", "wrong"])
async def test_grpc_without_the_token_is_unauthenticated(pair: EnginePair, metadata: tuple) -> None:
    async with grpc.aio.insecure_channel(pair.grpc_address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        for call in (stub.SetDraining(pb.SetDrainingRequest(draining=True), metadata=metadata),
                     migration_pb2_grpc.LlumletMigrationStub(channel).MigrateOut(
                         mpb.MigrateOutRequest(destination_address="127.0.0.1:1"), metadata=metadata)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(_request("bare"), metadata=metadata):
                pass
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with authenticated_channel(pair.grpc_address) as channel:
        assert not (await llumlet_pb2_grpc.LlumletStub(channel).GetLoad(pb.GetLoadRequest())).draining


async def test_grpc_with_the_token_is_served(pair: EnginePair) -> None:
    async with authenticated_channel(pair.grpc_address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        chunks = [response async for response in stub.Generate(_request("authed"))]
    assert sum(len(r.chunk.token_ids) for r in chunks) == 4


async def test_the_token_is_not_on_the_command_line(pair: EnginePair) -> None:
    assert pair.llumlet.pid is not None
    assert not any(SERVICE_TOKEN.value in arg for arg in psutil.Process(pair.llumlet.pid).cmdline())
