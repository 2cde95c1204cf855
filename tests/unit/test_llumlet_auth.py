"""Only callers that present the service token reach a llumlet: every gRPC method answers
UNAUTHENTICATED without it (or with a wrong one), the OpenAI API answers 401 in OpenAI's error shape,
/health and /metrics stay open for probes and Prometheus, and the authenticated caller is served."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from waiting import wait_until

from llumlet.__main__ import main as llumlet_main
from llumlet.server import Llumlet, LlumletConfig
from llumnix.launch.pair import free_port
from llumnix.llumlet_client import LlumletConnection
from llumnix.service_token import SERVICE_TOKEN_ENV, ServiceToken, call_metadata
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

TOKEN = ServiceToken("the-service-token")
WRONG = (("authorization", "Bearer not-the-token"),)


@pytest_asyncio.fixture
async def llumlet(tmp_path: Path) -> AsyncIterator[Llumlet]:
    # No engine answers: what is checked here is who gets in, not what the engine says.
    server = Llumlet(LlumletConfig(instance_id="u", engine_url=f"http://127.0.0.1:{free_port()}",
                                   snapshot_addr=f"ipc://{tmp_path / 'snap.sock'}", host="127.0.0.1",
                                   http_port=0, grpc_port=0, shutdown_grace_s=1.0, service_token=TOKEN))
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


def test_the_token_is_compared_as_a_bearer_credential_and_never_printed() -> None:
    assert TOKEN.accepts("Bearer the-service-token") and TOKEN.accepts("bearer  the-service-token")
    for presented in (None, "", "the-service-token", "Bearer the-service-toke", "Basic the-service-token",
                      "Bearer the-service-token-and-more"):
        assert not TOKEN.accepts(presented)
    assert "the-service-token" not in repr(TOKEN) and "the-service-token" not in repr([TOKEN])
    assert ServiceToken.from_environment({SERVICE_TOKEN_ENV: " t "}) == ServiceToken("t")
    assert ServiceToken.from_environment({SERVICE_TOKEN_ENV: ""}) is None
    assert ServiceToken.from_environment({}) is None
    assert ServiceToken.generate() != ServiceToken.generate()
    assert call_metadata(None) == ()


async def _code(call: object) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("metadata", [(), WRONG], ids=["missing", "wrong"])
async def test_every_grpc_method_refuses_a_caller_without_the_token(llumlet: Llumlet,
                                                                    metadata: tuple) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{llumlet.grpc_port}") as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        migration = migration_pb2_grpc.LlumletMigrationStub(channel)
        generate = pb.GenerateRequest(request_id="x", endpoint=pb.ENDPOINT_COMPLETION,
                                      body_json=json.dumps({"model": "m", "prompt": "hi"}))

        async def commands() -> AsyncIterator[pb.ServeCommand]:
            yield pb.ServeCommand(generate=generate)

        calls = {
            "GetLoad": stub.GetLoad(pb.GetLoadRequest(), metadata=metadata),
            "WatchLoad": stub.WatchLoad(pb.WatchLoadRequest(), metadata=metadata),
            "Generate": stub.Generate(generate, metadata=metadata),
            "Serve": stub.Serve(commands(), metadata=metadata),
            "Abort": stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata),
            "SetDraining": stub.SetDraining(pb.SetDrainingRequest(draining=True), metadata=metadata),
            "Health": stub.Health(pb.HealthRequest(), metadata=metadata),
            "MigrateOut": migration.MigrateOut(mpb.MigrateOutRequest(destination_address="127.0.0.1:1"),
                                               metadata=metadata),
            "Propose": migration.Propose(mpb.ProposeMigrationRequest(migration_id="m"), metadata=metadata),
            "Renew": migration.Renew(mpb.RenewMigrationRequest(migration_id="m"), metadata=metadata),
            "Commit": migration.Commit(mpb.CommitMigrationRequest(migration_id="m"), metadata=metadata),
            "Abort migration": migration.Abort(mpb.AbortMigrationRequest(migration_id="m"),
                                               metadata=metadata),
        }
        codes = {name: await _code(call) for name, call in calls.items()}
    assert codes == dict.fromkeys(calls, grpc.StatusCode.UNAUTHENTICATED)
    assert not llumlet.tracker.draining  # the refused SetDraining changed nothing


async def test_the_authenticated_caller_is_served_over_grpc(llumlet: Llumlet) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{llumlet.grpc_port}") as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        health = await stub.Health(pb.HealthRequest(), metadata=call_metadata(TOKEN))
        assert health.instance_id == "u"
    # The client the router and the control loop use presents the token on every call.
    connection = LlumletConnection(f"127.0.0.1:{llumlet.grpc_port}", token=TOKEN)
    try:
        drained = await connection.set_draining(True)
        assert drained.draining and llumlet.tracker.draining
        connection.start()
        await wait_until(lambda: connection.report is not None, "a load over the WatchLoad stream", 10)
        assert connection.report.load.draining
    finally:
        await connection.close()


async def test_http_asks_for_the_token_except_on_health_and_metrics(llumlet: Llumlet) -> None:
    base = f"http://127.0.0.1:{llumlet.http_port}"
    body = {"model": "m", "prompt": "hi"}
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN.value}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models")):
                async with session.request(method, base + path, json=body, headers=headers) as response:
                    assert response.status == 401, (path, headers)
                    error = (await response.json())["error"]
                    assert error["code"] == "invalid_api_key" and "service token" in error["message"]
        async with session.get(base + "/health") as response:
            assert response.status == 503  # open, and honest: no engine here
        async with session.get(base + "/metrics") as response:
            assert response.status == 200 and "llumnix_llumlet" in await response.text()
        authorized = {"Authorization": TOKEN.authorization}
        async with session.post(base + "/v1/completions", json=body, headers=authorized) as response:
            assert response.status == 503  # past the check: the engine is what is missing
            assert (await response.json())["error"]["type"] == "EngineUnavailable"


def test_the_llumlet_refuses_to_start_without_a_token_unless_told(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(SERVICE_TOKEN_ENV, raising=False)
    assert llumlet_main(["--snapshot-addr", "ipc:///nonexistent/snap.sock"]) == 2
    assert SERVICE_TOKEN_ENV in capsys.readouterr().err
