"""The control loop's decisions over an in-memory backend and fake llumlet connections whose loads
the tests set: instance count, replacement, drains (never stopping an instance that still runs
requests), migration pairing, autoscaling (counting the requests a real router holds) and adoption
after a restart."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from control_fakes import TOTAL_BLOCKS, Harness, request, settings
from waiting import wait_until

from llumnix.control.backend import InstancePhase
from llumnix.control.drains import EMPTY_BEFORE_RELEASE_S
from llumnix.control.fleet import UnknownInstance
from llumnix.control.router_queues import RouterQueues
from llumnix.router.api import ApiSettings
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router, RouterConfig
from llumnix.service_token import ServiceToken
from llumnix.v1 import migration_pb2 as mpb


async def test_starts_the_desired_count_then_holds_it() -> None:
    h = Harness(settings())
    assert await h.bring_up() == ["i0", "i1"]
    await h.loop.reconcile()
    assert h.backend.started == ["i0", "i1"] and h.backend.stopped == []
    assert h.addresses[-1] == {"addr-i0", "addr-i1"}
    status = h.loop.status()
    assert (status.ready, status.desired, status.scale_ups) == (2, 2, 2)
    assert status.aggregate_freeness == TOTAL_BLOCKS * 2


async def test_more_replicas_start_instances_fewer_drain_the_freest_and_release_it_when_empty() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.loop.update_settings(settings(replicas=3))
    assert await h.bring_up() == ["i0", "i1", "i2"]
    h.load("i0", request("a", 30))
    h.load("i1", request("b", 10))
    h.load("i2", request("c", 50))
    h.loop.update_settings(settings(replicas=2))
    await h.loop.reconcile()
    assert set(h.loop.draining) == {"i1"}  # the freest
    assert h.llumlets["i1"].draining_calls == [True]
    await h.loop.reconcile()
    h.clock.now += 60
    await h.loop.reconcile()
    assert h.backend.stopped == []  # still runs a request
    h.load("i1", draining=True)
    await h.loop.reconcile()
    assert h.backend.stopped == []  # empty, but not yet for long enough
    h.clock.now += EMPTY_BEFORE_RELEASE_S
    await h.loop.reconcile()
    assert h.backend.stopped == ["i1"]
    assert h.loop.status().releases == 1 and "Released" in h.reasons()
    await h.loop.reconcile()
    assert len(h.backend.started) == 3  # nothing restarted


async def test_a_lowered_instances_max_drains_the_autoscaled_surplus_and_raising_it_starts_nothing() -> None:
    autoscaled = {"enabled": True}
    h = Harness(settings(instances={"min": 3, "max": 3}, replicas=3, autoscaling=autoscaled))
    assert await h.bring_up() == ["i0", "i1", "i2"]  # autoscaled from instances.min
    h.load("i0", request("a", 30))
    h.load("i1", request("b", 10))
    h.load("i2", request("c", 50))
    h.loop.update_settings(settings(instances={"min": 1, "max": 2}, replicas=3, autoscaling=autoscaled))
    await h.loop.reconcile()
    assert set(h.loop.draining) == {"i1"} and h.loop.desired == 2  # the freest drains
    h.loop.update_settings(settings(instances={"min": 1, "max": 3}, replicas=2, autoscaling=autoscaled))
    await h.loop.reconcile()
    assert h.loop.desired == 2 and set(h.loop.draining) == {"i1"} and len(h.backend.started) == 3
    h.loop.update_settings(settings(instances={"min": 3, "max": 3}, replicas=2, autoscaling=autoscaled))
    await h.loop.reconcile()
    assert h.loop.desired == 3 and not h.loop.draining  # a raised minimum puts the drained one back


async def test_a_decision_records_the_aggregate_freeness_it_was_taken_at() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.load("i0", request("a", 30))
    h.load("i1", request("b", 10))
    h.loop.update_settings(settings(replicas=1))
    await h.loop.reconcile()
    decision = h.loop.status().last_decision
    assert decision is not None and (decision.kind, decision.instance_id) == ("drain", "i1")
    assert decision.aggregate_freeness == (2 * TOTAL_BLOCKS - 40) / 2  # both serving when decided
    assert h.loop.status().aggregate_freeness == TOTAL_BLOCKS - 30  # i1 drains: counted no more


async def test_a_failed_instance_is_stopped_and_replaced() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.backend.set_phase("i0", InstancePhase.FAILED, "engine exited (code -9)")
    await h.loop.reconcile()
    assert h.backend.stopped == ["i0"]
    assert h.backend.started == ["i0", "i1", "i2"]
    assert h.reasons()[-2:] == ["InstanceFailed", "Replaced"]
    status = h.loop.status()
    assert (status.replacements, status.scale_ups) == (1, 2)
    assert "engine exited" in h.events[-2].message


async def test_repeated_failures_back_off_the_successors() -> None:
    h = Harness(settings(replicas=1))
    await h.bring_up()
    h.backend.set_phase("i0", InstancePhase.FAILED)
    await h.loop.reconcile()
    assert h.backend.started == ["i0", "i1"]  # the first successor starts at once
    h.backend.set_phase("i1", InstancePhase.FAILED)
    await h.loop.reconcile()
    assert h.backend.started == ["i0", "i1"]  # the second waits 1 s
    h.clock.now += 1
    await h.loop.reconcile()
    assert h.backend.started == ["i0", "i1", "i2"]
    h.backend.ready("i2")
    h.load("i2")
    await h.loop.reconcile()
    h.backend.set_phase("i2", InstancePhase.FAILED)
    await h.loop.reconcile()
    assert h.backend.started[-1] == "i3"  # serving again reset the backoff


async def test_an_instance_not_ready_within_the_grace_period_is_replaced() -> None:
    h = Harness(settings())
    await h.loop.reconcile()
    h.backend.ready("i0")
    h.load("i0")
    h.clock.now += 31
    await h.loop.reconcile()
    assert h.backend.stopped == ["i1"] and h.backend.started == ["i0", "i1", "i2"]


async def test_an_admin_drain_waits_for_the_requests_then_releases_and_replaces() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.load("i0", request("a", 20))
    with pytest.raises(UnknownInstance):
        await h.loop.drain("nope")
    await h.loop.drain("i0")
    assert h.loop.status().instances[0].draining
    await h.loop.reconcile()
    assert h.backend.started[-1] == "i2"  # a surge replacement keeps two serving
    h.backend.ready("i2")
    h.load("i2")
    for _ in range(3):
        h.clock.now += 10
        await h.loop.reconcile()
    assert "i0" not in h.backend.stopped
    h.load("i0", draining=True)
    await h.loop.reconcile()
    h.clock.now += EMPTY_BEFORE_RELEASE_S
    await h.loop.reconcile()
    assert h.backend.stopped == ["i0"]


async def test_a_drain_that_outlives_the_timeout_stops_the_instance_and_says_so() -> None:
    h = Harness(settings())
    h.loop.drain_timeout_s = 100
    await h.bring_up()
    h.load("i0", request("a", 20))
    await h.loop.drain("i0")
    h.clock.now += 101
    await h.loop.reconcile()
    assert "i0" in h.backend.stopped
    timeout = next(e for e in h.events if e.reason == "DrainTimeout")
    assert timeout.kind == "Warning" and "1 requests" in timeout.message


async def test_undrain_cancels_a_drain() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.load("i0", request("a", 20))
    await h.loop.drain("i0")
    await h.loop.undrain("i0")
    assert h.llumlets["i0"].draining_calls == [True, False]
    assert not h.loop.draining


async def test_migration_pairs_an_overloaded_source_with_the_freest_one_in_flight_per_source() -> None:
    h = Harness(settings(migration={"freenessThreshold": 5}))
    await h.bring_up()
    h.load("i0", *(request(f"r{k}", 24, arrival=k) for k in range(4)))  # 4 free blocks over 4 requests
    h.load("i1")
    h.llumlets["i0"].hold = asyncio.Event()
    await h.loop.migrate_pass()
    await asyncio.sleep(0)
    await h.loop.migrate_pass()
    await asyncio.sleep(0)
    assert len(h.migrations) == 1
    source, sent = h.migrations[0]
    assert (source, sent.destination_instance_id, sent.destination_address) == ("i0", "i1", "addr-i1")
    assert sent.select == mpb.MIGRATION_SELECT_LAST_COME and sent.request_id == ""
    h.llumlets["i0"].hold.set()
    await wait_until(lambda: h.loop.status().migrations == {"committed": 1}, "the held migration committed")
    await h.loop.migrate_pass()
    await wait_until(lambda: len(h.migrations) == 2, "a second migration once the first ended")


async def holding_router() -> tuple[Router, RouterQueues]:
    """A started router with no instance of its own (it holds every request it gets), and the control
    loop's reader of its held requests."""
    token = ServiceToken.generate()
    router = Router(RouterConfig(api=ApiSettings(model="m"), host="127.0.0.1", port=0, service_token=token,
                                 shutdown_grace_s=0.1), ListInstanceSource([]))
    await router.start()

    async def router_urls() -> list[str]:
        return [router.url]

    return router, RouterQueues(router_urls, token)


async def test_migration_leaves_the_room_a_request_held_by_the_router_waits_for() -> None:
    router, queues = await holding_router()
    h = Harness(settings(), router_queues=queues)
    async with aiohttp.ClientSession() as session:
        try:
            await h.bring_up()
            h.load("i0", *(request(f"c{k}", 23) for k in range(4)))  # freeness 8 / 4 = 2: a source
            h.load("i1", *(request(f"r{k}", 10) for k in range(3)))  # 70 / 3 = 23: a destination
            body = {"model": "m", "prompt": [7] * 1700, "max_tokens": 4}  # 107 blocks: fits nowhere
            held = asyncio.create_task(session.post(router.url + "/v1/completions", json=body))
            await wait_until(lambda: len(router.queue) == 1, "the router holds the request")
            # It waits for i1's room, which a request moved in would take: (100 - 30 - 107) / 4 < 3.
            await h.loop.migrate_pass()
        finally:
            await router.shutdown()  # the held request gets a 503
        async with await held as response:
            assert response.status == 503
    # A MigrateOut the pass had started would be recorded by now: its task's first step (which records
    # it) ran while the router shut down and the response came back.
    assert h.migrations == []
    try:
        await h.loop.migrate_pass()  # nothing held now (the router is gone): i0 moves a request to i1
        await wait_until(lambda: h.migrations, "a migration once nothing is held")
        assert [(source, sent.destination_instance_id) for source, sent in h.migrations] == [("i0", "i1")]
    finally:
        await h.loop.close()


async def test_a_draining_instance_is_a_migration_source() -> None:
    h = Harness(settings())
    await h.bring_up()
    h.load("i0", request("a", 5))
    await h.loop.drain("i0")
    await h.loop.migrate_pass()
    await wait_until(lambda: h.migrations, "a migration out of the draining instance")
    assert [(s, r.destination_instance_id) for s, r in h.migrations] == [("i0", "i1")]


async def test_migration_errors_are_counted_and_the_loop_goes_on() -> None:
    h = Harness(settings(migration={"freenessThreshold": 5}))
    await h.bring_up()
    h.load("i0", *(request(f"r{k}", 24) for k in range(4)))
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 "not here")
    h.llumlets["i0"].migrate_result = error
    for attempt in range(1, 3):
        await h.loop.migrate_pass()
        await wait_until(lambda attempt=attempt: h.loop.status().migrations.get("unsupported") == attempt,
                         f"failed migration {attempt} counted")
    assert h.loop.status().migrations == {"unsupported": 2}


async def test_admin_migrate_names_the_request_and_checks_instances() -> None:
    h = Harness(settings())
    await h.bring_up()
    result = await h.loop.migrate("req-7", "i0", "i1")
    assert result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED
    assert h.migrations[0][1].request_id == "req-7"
    with pytest.raises(UnknownInstance):
        await h.loop.migrate(None, "i0", "i9")
    with pytest.raises(ValueError):
        await h.loop.migrate(None, "i0", "i0")


async def test_autoscaling_adds_an_instance_when_the_cluster_is_short_and_drains_one_when_idle() -> None:
    service = settings(instances={"min": 2, "max": 4}, replicas=2,
                       autoscaling={"enabled": True, "scaleDownStabilizationSeconds": 5.0,
                                    "parkSeconds": 0.0})
    h = Harness(service)
    await h.bring_up()
    h.load("i0", *(request(f"a{k}", 24) for k in range(4)))
    h.load("i1", *(request(f"b{k}", 24) for k in range(4)))
    await h.loop.autoscale()
    assert h.backend.started == ["i0", "i1", "i2"]
    assert h.loop.status().last_decision.kind == "scale-up"
    await h.bring_up()
    h.load("i0")
    h.load("i1")
    h.load("i2", request("c", 2))
    await h.loop.autoscale()
    assert not h.loop.draining  # wanted, but not for the stabilization window yet
    h.clock.now += 5
    await h.loop.autoscale()
    assert list(h.loop.draining) == ["i1"] and h.loop.desired == 2  # idle (i0 and i1) and last by id
    h.clock.now += EMPTY_BEFORE_RELEASE_S
    await h.loop.reconcile()
    h.clock.now += EMPTY_BEFORE_RELEASE_S
    await h.loop.reconcile()
    assert h.backend.stopped == ["i1"]
    await h.loop.autoscale()
    assert h.backend.stopped == ["i1"]  # at min_instances


async def test_a_drained_instance_is_parked_and_a_scale_up_puts_it_back_instead_of_starting_one() -> None:
    # At most 2: the parked instance is all a scale-up may add (what it starts beyond a parked
    # instance: test_autoscaling_policy).
    service = settings(instances={"min": 1, "max": 2},
                       autoscaling={"enabled": True, "scaleDownStabilizationSeconds": 0.0,
                                    "parkSeconds": 30.0})
    h = Harness(service)
    await h.bring_up()
    h.load("i0", *(request(f"a{k}", 24) for k in range(4)))  # (100 - 96) / 4 = 1 < 10
    await h.loop.autoscale()
    assert await h.bring_up() == ["i0", "i1"]
    h.load("i0")
    await h.loop.autoscale()
    assert list(h.loop.draining) == ["i1"] and h.loop.desired == 1  # both idle: the last by id
    h.load("i1", draining=True)
    await h.loop.reconcile()
    h.clock.now += 29
    await h.loop.reconcile()
    assert h.backend.stopped == [] and h.loop.draining["i1"].empty_since is not None  # parked
    h.load("i0", *(request(f"a{k}", 24) for k in range(4)))  # (100 - 96) / 4 = 1 < 10
    await h.loop.autoscale()
    assert h.loop.status().last_decision.kind == "cancel-drain" and "DrainCancelled" in h.reasons()
    assert not h.loop.draining and h.llumlets["i1"].draining_calls[-1] is False
    assert h.backend.started == ["i0", "i1"] and h.loop.desired == 2  # nothing started
    await h.loop.reconcile()
    assert h.backend.started == ["i0", "i1"] and h.backend.stopped == []
    # Idle again: drained, parked for the whole 30 s, then stopped.
    h.load("i0")
    h.load("i1")
    await h.loop.autoscale()
    h.load("i1", draining=True)
    await h.loop.reconcile()
    h.clock.now += 30
    await h.loop.reconcile()
    assert h.backend.stopped == ["i1"] and "Released" in h.reasons()


async def test_a_restarted_loop_adopts_what_exists_and_changes_nothing() -> None:
    first = Harness(settings(replicas=3))
    await first.bring_up()
    first.load("i0", request("a", 10))
    await first.loop.drain("i0")
    await first.loop.reconcile()
    started = list(first.backend.started)
    second = Harness(settings(replicas=3), backend=first.backend, loads=first.loads)
    await second.loop.reconcile()
    await second.loop.reconcile()
    assert first.backend.started == started and first.backend.stopped == []
    assert set(second.loop.draining) == {"i0"}
    assert second.events == []


@pytest.mark.parametrize(("blocks_after", "started"), [
    # 13 now; demand rose 80 -> 96 blocks, 30 s ahead 144: (200 - 144) / 8 = 7 -> start one
    (12, 3),
    # 10 now; demand rose 80 -> 120 blocks, 30 s ahead 240: the bound needs 8 * 10 + 240 = 320 blocks
    # of capacity, 200 serve -> two more, started together
    (15, 4),
])
async def test_autoscaling_starts_what_rising_demand_needs_one_start_up_ahead(blocks_after: int,
                                                                            started: int) -> None:
    # 100 blocks per instance; default bounds [10, 60], interval 10 s, start-up horizon 30 s (grace).
    service = settings(instances={"min": 2, "max": 6}, replicas=2, autoscaling={"enabled": True})
    h = Harness(service)
    await h.bring_up()
    h.load("i0", *(request(f"a{k}", 10) for k in range(4)))
    h.load("i1", *(request(f"b{k}", 10) for k in range(4)))
    await h.loop.autoscale()  # (200 - 80) / 8 = 15: between the bounds, nothing to do
    assert h.backend.started == ["i0", "i1"]
    h.load("i0", *(request(f"a{k}", blocks_after) for k in range(4)))
    h.load("i1", *(request(f"b{k}", blocks_after) for k in range(4)))
    await h.loop.autoscale()
    assert h.backend.started == [f"i{k}" for k in range(started)] and h.loop.desired == started
    assert h.loop.status().last_decision.kind == "scale-up"


async def test_autoscaling_counts_the_requests_a_router_holds() -> None:
    router, queues = await holding_router()  # it will hold six requests of 160 tokens (10 blocks)
    service = settings(instances={"min": 2, "max": 6}, replicas=2, autoscaling={"enabled": True})
    h = Harness(service, router_queues=queues)
    async with aiohttp.ClientSession() as session:

        async def complete() -> int:
            body = {"model": "m", "prompt": [7] * 160, "max_tokens": 4}
            async with session.post(router.url + "/v1/completions", json=body) as response:
                return response.status

        try:
            await h.bring_up()
            h.load("i0", *(request(f"a{k}", 10) for k in range(4)))
            h.load("i1", *(request(f"b{k}", 10) for k in range(4)))
            await h.loop.autoscale()  # (200 - 80) / 8 = 15: between the bounds, nothing to do
            assert h.backend.started == ["i0", "i1"]
            held = [asyncio.create_task(complete()) for _ in range(6)]
            await wait_until(lambda: len(router.queue) == 6, "six requests held by the router")
            # The same loads, plus 60 blocks and 6 requests held: (200 - 140) / 14 = 4.3 < 10. Demand
            # rose 80 -> 140 blocks in one interval, 30 s ahead 320: the bound needs 14 * 10 + 320 = 460
            # blocks of capacity, 200 serve -> three more.
            await h.loop.autoscale()
            decision = h.loop.status().last_decision
            assert decision is not None and decision.kind == "scale-up"
            assert "6 requests held by the routers" in decision.reason
            assert h.backend.started == [f"i{k}" for k in range(5)]
        finally:
            await router.shutdown()  # the held requests get a 503
            await h.loop.close()
        assert await asyncio.gather(*held) == [503] * 6
