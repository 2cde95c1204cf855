"""The admin API over a control loop (fake backend and llumlets), the `llumnix admin` CLI against it,
and the example manifests in deploy/examples."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from control_fakes import Harness, request, settings

from llumnix import admin_cli
from llumnix.admin_cli import format_status
from llumnix.control.admin_api import admin_app
from llumnix.control.status import InstanceStatus, ServiceStatus, headroom
from llumnix.service_spec import load_service_file
from llumnix.up import status_line
from llumnix.v1 import migration_pb2 as mpb

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


@pytest.fixture
async def admin() -> tuple[Harness, TestClient]:
    h = Harness(settings())
    await h.bring_up()
    h.load("i0", request("a", 10))
    client = TestClient(TestServer(admin_app(h.loop)))
    await client.start_server()
    yield h, client
    await client.close()


async def test_status_lists_instances_with_their_loads(admin: tuple[Harness, TestClient]) -> None:
    _, client = admin
    response = await client.get("/instances")
    assert response.status == 200
    body = await response.json()
    assert [i["instance_id"] for i in body["instances"]] == ["i0", "i1"]
    assert body["instances"][0]["running"] == 1 and body["ready"] == 2 and body["desired"] == 2
    assert body["instances"][0]["freeness"] == pytest.approx(90.0)
    assert body["aggregate_freeness"] == pytest.approx(200 - 10)  # both seen as one, 1 request


def test_local_mode_status_line_shows_the_headroom_per_instance_and_aggregate() -> None:
    status = ServiceStatus("svc", 2, (InstanceStatus("svc-0", "ready", "a:1", 20.0, running=2, block_size=16),
                                      InstanceStatus("svc-1", "ready", "b:1", 40.0, running=1, block_size=16),
                                      InstanceStatus("svc-2", "ready", "c:1", float("-inf"), running=1,
                                                     draining=True, block_size=16)),
                           aggregate_freeness=27.4)
    line = status_line(status, in_flight=0)
    assert "headroom 0:320 decode steps, 1:640 decode steps, 2:draining (aggregate 438 decode steps)" in line


def test_an_idle_instance_reads_as_idle_not_as_its_free_blocks() -> None:
    idle = InstanceStatus("svc-0", "ready", "a:1", 32759.0, block_size=16)
    busy = InstanceStatus("svc-1", "ready", "b:1", 12.5, running=4, block_size=16)
    status = ServiceStatus("svc", 2, (idle, busy), aggregate_freeness=6553.0)
    assert "headroom 0:idle, 1:200 decode steps" in status_line(status, in_flight=4)
    assert headroom(idle.freeness, idle.block_size, idle=idle.idle) == "idle"
    assert headroom(busy.freeness, busy.block_size, idle=busy.idle) == "200 decode steps"
    assert headroom(float("-inf"), 16, idle=False, draining=True) == "draining"
    table = format_status(status.to_json())
    assert "idle" in table and "200 decode steps" in table and "decode steps each running request" in table
    quiet = ServiceStatus("svc", 1, (idle,), aggregate_freeness=32759.0)
    assert "(aggregate idle)" in status_line(quiet, in_flight=0)


async def test_drain_then_undrain_through_the_api(admin: tuple[Harness, TestClient]) -> None:
    h, client = admin
    response = await client.post("/instances/i0/drain")
    assert response.status == 200 and (await response.json())["draining"] is True
    body = await (await client.get("/instances")).json()
    assert body["instances"][0]["draining"] is True and body["instances"][0]["freeness"] is None
    assert body["last_decision"]["aggregate_freeness"] == pytest.approx(200 - 10)  # when decided
    assert body["aggregate_freeness"] == pytest.approx(100)  # i1 alone
    assert (await client.post("/instances/i0/undrain")).status == 200
    assert h.llumlets["i0"].draining_calls == [True, False]
    missing = await client.post("/instances/zz/drain")
    assert missing.status == 404 and "zz" in (await missing.json())["error"]


async def test_migrate_through_the_api(admin: tuple[Harness, TestClient]) -> None:
    h, client = admin
    h.llumlets["i0"].migrate_result = mpb.MigrateOutResponse(
        outcome=mpb.MIGRATION_OUTCOME_COMMITTED, downtime_ms=30.0, final_stage_ms=8.0, commit_ms=21.0,
        destination_first_token_ms=18.0, destination_admitted_ms=9.0, destination_kv_load_ms=0.5)
    response = await client.post("/migrate", json={"source": "i0", "destination": "i1", "request_id": "a"})
    assert response.status == 200
    answer = await response.json()
    assert answer["outcome"] == "committed" and answer["downtime_ms"] == 30.0
    assert answer["downtime_parts_ms"] == {
        "final_stage": 8.0, "final_stage_kv": 0.0, "final_stage_event": 0.0, "commit": 21.0,
        "destination_first_token": 18.0, "destination_admitted": 9.0, "destination_kv_load": 0.5}
    assert h.migrations[0][1].request_id == "a"
    assert (await client.post("/migrate", json={"source": "i0"})).status == 400
    assert (await client.post("/migrate", data=b"{")).status == 400
    assert (await client.post("/migrate", json={"source": "i0", "destination": "x"})).status == 404
    h.llumlets["i0"].migrate_result = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    failed = await client.post("/migrate", json={"source": "i0", "destination": "i1"})
    assert failed.status == 502 and "UNAVAILABLE" in (await failed.json())["error"]


def admin_args(url: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    admin_cli.add_arguments(parser)
    return parser.parse_args(["--url", url, *argv])


async def test_the_cli_prints_a_table_and_clear_errors(admin: tuple[Harness, TestClient],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, client = admin
    url = str(client.make_url("")).rstrip("/")
    assert await asyncio.to_thread(admin_cli.run, admin_args(url, "status")) == 0
    out = capsys.readouterr().out
    assert "i0" in out and "90.0" in out and "2 ready / 2 desired, aggregate freeness 190.0" in out
    assert await asyncio.to_thread(admin_cli.run, admin_args(url, "drain", "nope")) == 1
    assert "nope" in capsys.readouterr().err
    code = await asyncio.to_thread(admin_cli.run, admin_args(url, "migrate", "--source", "i0",
                                                             "--destination", "i1"))
    out = capsys.readouterr().out
    assert code == 0 and "migration committed" in out
    assert "final stage 0.0 ms, Commit 0.0 ms of which 0.0 ms to the destination's first token" in out


def test_the_cli_says_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin_cli.run(admin_args("http://127.0.0.1:9", "status")) == 1
    assert "cannot reach the admin API" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_manifests_validate(path: Path) -> None:
    service = load_service_file(str(path))
    assert service.desired_instances >= 1


def test_the_examples_cover_local_cpu_sim_autoscaling_and_gpu() -> None:
    runtimes = {p.name: load_service_file(str(p)).spec for p in EXAMPLES.glob("*.yaml")}
    assert runtimes["local-cpu.yaml"].engine.runtime == "vllm-cpu"
    assert runtimes["local-sim.yaml"].instances.min == 16
    assert runtimes["autoscale-sim.yaml"].autoscaling.enabled
    assert runtimes["gpu-cluster.yaml"].engine.resources.gpus == 1


def test_options_may_come_before_or_after_the_action() -> None:
    parser = argparse.ArgumentParser()
    admin_cli.add_arguments(parser)
    assert parser.parse_args(["status", "--url", "http://a:1"]).url == "http://a:1"
    assert parser.parse_args(["--url", "http://b:2", "drain", "x"]).url == "http://b:2"
    assert parser.parse_args(["status"]).url == admin_cli.DEFAULT_ADMIN_URL
    assert parser.parse_args(["--json", "status"]).json is True
