"""The control loop over real local processes (sim engines + llumlets) with the router in front, in
real time: the llumnix dispatch policy against round-robin on 16 instances, autoscaling up and back
down with every request completed, a drained instance parked and put back by a scale-up, replacement
of a killed instance, the admin API's drain and migrate, and the migration rule under a burst."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from llumnix.bench import BenchConfig, run_bench
from llumnix.control import migration_pass
from llumnix.control.status import ControlEvent
from llumnix.load import InstanceLoad, freeness
from llumnix.policies.migration import MigrationPair, pair_migrations
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router
from llumnix.traces import generate_trace
from llumnix.up import LocalService, router_config

pytestmark = [pytest.mark.timeout(480)]

MODEL = "sim"
StartService = Callable[..., Awaitable[LocalService]]


def manifest(name: str, instances: int, engine_args: list[str], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
            "spec": {"model": {"name": MODEL},
                     "engine": {"runtime": "sim", "blockSize": 16, "args": engine_args},
                     "instances": {"min": instances, "max": instances}, **spec}}


@pytest_asyncio.fixture
async def start_service(tmp_path: Path) -> AsyncIterator[StartService]:
    """`await start_service(manifest)`: a LocalService (engines, loop, router, admin API) on free
    ports, returned once every instance serves through the router; shut down after the test."""
    services: list[LocalService] = []

    async def start(document: dict[str, Any], events: list[ControlEvent] | None = None) -> LocalService:
        path = tmp_path / f"{document['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(document), encoding="utf-8")
        service = LocalService(str(path), tmp_path / document["metadata"]["name"], None, port=0,
                               on_event=(events.append if events is not None else lambda _: None))
        services.append(service)
        await service.start()
        assert await asyncio.wait_for(service.wait_serving(asyncio.Event()), 240)
        return service

    yield start
    for service in services:
        await service.shutdown()


async def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


# 64 blocks of 16 tokens: a few long requests fill an instance, so placement matters.
SMALL_ENGINE = ["--num-blocks", "64", "--max-model-len", "1000", "--time-scale", "2"]


async def served(router: Router, trace: list) -> dict:
    """The bench summary of `trace` through `router`; every request must have finished, error-free."""
    result = await run_bench(BenchConfig(url=router.url, model=MODEL, show_progress=False), trace)
    summary = result.summary()
    assert summary["errors"] == 0 and summary["finished"] == len(trace), result.errors_by_kind
    return summary


async def test_16_instances_serve_a_bursty_trace_under_llumnix_and_round_robin(start_service: StartService
                                                                             ) -> None:
    # Service under a saturated machine, not latency: this trace at this speed keeps 2 cores busy, so
    # TTFTs measure CPU starvation. The P99 comparison is bench/router_policies_p99.py (memory-bound
    # settings; docs/local-mode.md).
    service = await start_service(manifest("sixteen", 16, SMALL_ENGINE, migration={"enabled": False}))
    # Bursty (CV 3) arrivals of a power-law length mix: round-robin lands requests behind long ones.
    trace = generate_trace("S-S", num_requests=240, rate=16.0, cv=3.0, seed=1, max_total_tokens=600)
    llumnix = await served(service.router, trace)
    config = replace(router_config(service.service_file, "127.0.0.1", 0, 1000, dispatch_policy="round-robin"),
                     service_token=service.token)  # the service's llumlets require its token
    round_robin_router = Router(config, ListInstanceSource(service.source.addresses))
    await round_robin_router.start()
    try:
        await wait_for(lambda: len(round_robin_router.instances.dispatchable()) == 16, 30, "load streams")
        round_robin = await served(round_robin_router, trace)
    finally:
        await round_robin_router.shutdown()
    print(f"\n[16 instances] P99 TTFT llumnix {llumnix['prefill_p99']:.2f} s, "
          f"round-robin {round_robin['prefill_p99']:.2f} s (a saturated machine: not a policy comparison)")


async def test_autoscaling_goes_up_under_load_and_back_down_with_every_request_completed(
        start_service: StartService) -> None:
    events: list[ControlEvent] = []
    document = manifest("autoscale", 2, SMALL_ENGINE,
                        autoscaling={"enabled": True, "scaleUpBelow": 10, "scaleDownAbove": 60,
                                     "intervalSeconds": 0.5, "scaleDownStabilizationSeconds": 2,
                                     "parkSeconds": 0},  # released once empty (parking: the next test)
                        migration={"enabled": True, "intervalMs": 100})
    document["spec"]["instances"] = {"min": 2, "max": 4}
    service = await start_service(document, events)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, service.loop.status().ready)
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    try:
        trace = generate_trace("S-S", num_requests=120, rate=10.0, cv=1.0, seed=2, max_total_tokens=600)
        result = await run_bench(BenchConfig(url=service.router.url, model=MODEL, show_progress=False), trace)
        await wait_for(lambda: service.loop.status().ready == 2 and service.loop.releases >= 1, 90,
                       "scale back down to 2")
    finally:
        watcher.cancel()
    summary = result.summary()
    assert summary["errors"] == 0 and summary["finished"] == 120, result.errors_by_kind
    assert peak > 2
    reasons = [e.reason for e in events]
    assert "ScaledUp" in reasons and "Draining" in reasons and "Released" in reasons


async def test_a_drained_instance_stays_parked_and_a_scale_up_puts_it_back(
        start_service: StartService) -> None:
    events: list[ControlEvent] = []
    document = manifest("park", 1, SMALL_ENGINE,
                        autoscaling={"enabled": True, "scaleUpBelow": 10, "scaleDownAbove": 60,
                                     "intervalSeconds": 0.5, "scaleDownStabilizationSeconds": 1,
                                     "parkSeconds": 600},
                        migration={"enabled": True, "intervalMs": 100})
    document["spec"]["instances"] = {"min": 1, "max": 2}
    service = await start_service(document, events)
    bench = BenchConfig(url=service.router.url, model=MODEL, show_progress=False)
    trace = generate_trace("S-S", num_requests=60, rate=10.0, cv=1.0, seed=2, max_total_tokens=600)

    def reasons(reason: str) -> list[ControlEvent]:
        return [e for e in events if e.reason == reason]

    first = await run_bench(bench, trace)  # short on one instance: a second one starts
    await wait_for(lambda: len(reasons("ScaledUp")) == 2 and service.loop.status().ready == 2, 90,
                   "the second instance serving")
    await wait_for(lambda: bool(reasons("Draining")), 90, "a scale-down drain once idle")
    parked = reasons("Draining")[0].instance_id
    assert parked is not None
    await wait_for(lambda: parked in service.loop.draining
                   and service.loop.draining[parked].empty_since is not None, 60,
                   "the drained instance empty")
    second = await run_bench(bench, trace)  # short again: the parked instance is put back
    await wait_for(lambda: any(e.instance_id == parked for e in reasons("DrainCancelled")), 60,
                   "the parked instance put back")
    for result in (first, second):
        summary = result.summary()
        assert summary["errors"] == 0 and summary["finished"] == 60, result.errors_by_kind
    assert parked in service.loop.instances and parked not in service.loop.draining
    assert reasons("Released") == [] and len(reasons("ScaledUp")) == 2  # kept, and nothing new started


async def test_a_killed_instance_is_replaced(start_service: StartService) -> None:
    events: list[ControlEvent] = []
    service = await start_service(manifest("replace", 2, []), events)
    victim = sorted(service.backend._instances)[0]
    service.backend.pair(victim).kill_engine()
    await wait_for(lambda: service.loop.replacements == 1 and service.serving()
                   and victim not in service.loop.instances, 90, "a serving replacement")
    assert [e.reason for e in events if e.instance_id == victim] == ["ScaledUp", "InstanceFailed"]
    assert "Replaced" in [e.reason for e in events]
    async with aiohttp.ClientSession() as session, session.post(
            service.router.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4}
    ) as response:
        assert response.status == 200


async def test_admin_api_drains_an_instance_and_migrates_a_request(start_service: StartService) -> None:
    service = await start_service(manifest("admin", 2, ["--time-scale", "0.5"], migration={"enabled": False}))
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "x" * 64, "max_tokens": 400, "ignore_eos": True, "stream": True}
        stream = await session.post(service.router.url + "/v1/completions", json=body)
        await stream.content.readline()
        await wait_for(lambda: sum(i.running for i in service.loop.status().instances) == 1, 20,
                       "the request running")
        source = next(i.instance_id for i in service.loop.status().instances if i.running)
        destination = next(i.instance_id for i in service.loop.status().instances if not i.running)
        async with session.post(f"{service.admin_url}/migrate",
                                json={"source": source, "destination": destination}) as response:
            migrated = await response.json()
        assert response.status == 200, migrated
        assert migrated["outcome"] == "committed", migrated
        text = b"".join([line async for line in stream.content])
        assert b"[DONE]" in text
        stream.release()
        async with session.post(f"{service.admin_url}/instances/{destination}/drain") as response:
            assert response.status == 200
        await wait_for(lambda: destination not in service.loop.instances and service.serving(), 60,
                       "the drained instance released and replaced")
    assert service.loop.releases == 1


async def test_migrations_under_a_burst_keep_their_destinations_free(start_service: StartService,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed migration rule at work on real load snapshots: under a bursty load the loop pairs a
    source only with destinations at or above the destination floor (what the llumlet's `admits` then
    checks with the request added); instances between the source threshold and the floor, which the
    old rule would have filled, are skipped; migrations to free instances are made and committed."""
    passes: list[tuple[list[InstanceLoad], list[MigrationPair], list[MigrationPair]]] = []

    def recording(loads, config, model):  # the real policy, with its inputs and answer kept
        pairs = pair_migrations(loads, config, model)
        old = replace(config, destination_freeness=config.freeness_threshold)  # floor = threshold
        old_rule = pair_migrations(loads, old, model)
        passes.append((list(loads), pairs, old_rule))
        return pairs

    monkeypatch.setattr(migration_pass, "pair_migrations", recording)
    service = await start_service(manifest("burst", 4, SMALL_ENGINE,
                                           migration={"enabled": True, "intervalMs": 100}))
    trace = generate_trace("L-L", num_requests=80, rate=6.0, cv=3.0, seed=3, max_total_tokens=600)
    result = await run_bench(BenchConfig(url=service.router.url, model=MODEL, show_progress=False), trace)
    summary = result.summary()
    assert summary["errors"] == 0 and summary["finished"] == 80, result.errors_by_kind
    config = service.settings.migration
    floor = config.destination_freeness
    skipped = 0
    for loads, pairs, old_rule in passes:
        by_id = {load.instance_id: load for load in loads}
        for pair in pairs:
            assert freeness(by_id[pair.destination]) >= floor, (pair, by_id[pair.destination])
        skipped += sum(1 for pair in old_rule if freeness(by_id[pair.destination]) < floor)
    assert skipped > 0, "the burst never met a destination between the threshold and the floor"
    assert service.loop.status().migrations.get("committed", 0) > 0, service.loop.status().migrations
