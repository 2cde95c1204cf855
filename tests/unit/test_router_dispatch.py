"""Router dispatch over instances' loads: in-flight accounting between snapshots, holding requests
while every instance is busy, the bounded priority queue, the prefix lookup's keys."""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
from dispatch_reference import random_load, random_request, reference_choice
from waiting import wait_until

from llumnix.load import InstanceLoad, RequestLoad, engine_queues
from llumnix.openai_stream import EndpointKind
from llumnix.policies.dispatch import MAX_HOLD_S, ScoringPolicy, make_dispatch_policy
from llumnix.prefix_cache import block_hashes, root_hash
from llumnix.router.dispatcher import Dispatcher, DispatchQueue
from llumnix.router.errors import RouterError
from llumnix.router.instances import Instance, InstanceSet
from llumnix.router.prompt_ids import PromptTokens
from llumnix.v1 import llumlet_pb2
from llumnix.wire import LoadReport, LoadSource, report_from_proto, source_to_proto


def report(instance_id: str, free_blocks: int = 100, running: tuple[RequestLoad, ...] = (),
           waiting: tuple[RequestLoad, ...] = (), sequence: int = 1, total_blocks: int = 100) -> LoadReport:
    load = InstanceLoad(instance_id, total_blocks, free_blocks, block_size=16, running=running,
                        waiting=waiting, timestamp=float(sequence))
    return LoadReport(load, 0.0, 0.0, 0.0, LoadSource.CONNECTOR, sequence)


def cluster(*reports: LoadReport, on_change: Callable[[], None] = lambda: None) -> InstanceSet:
    instances = InstanceSet(on_change=on_change)
    for r in reports:
        instance = instances.add(f"127.0.0.1:{len(instances) + 1}", watch=False)
        instance.observe(r)
    return instances


def request(i: int, tokens: int = 160, high: bool = False) -> RequestLoad:
    return RequestLoad(f"r{i}", tokens, high_priority=high)


async def test_a_request_after_a_long_prompt_goes_where_nothing_queues_ahead_of_it() -> None:
    """The router's own pending requests count as queued: right after a 6,000-token prompt (375 of
    1,000 blocks) went to the roomiest instance, a short request goes to an instance without a queue
    rather than wait there for that prefill, though by freeness alone the roomy one is still freer:
    (1000 - 4 - 375 - 1) / 6 = 103 against (1000 - 700 - 1) / 3 = 99.7."""
    def running(instance_id: str, count: int) -> tuple[RequestLoad, ...]:
        return tuple(RequestLoad(f"{instance_id}-r{k}", 16, blocks=1) for k in range(count))

    instances = cluster(report("roomy", free_blocks=996, running=running("roomy", 4), total_blocks=1000),
                        report("snug", free_blocks=300, running=running("snug", 2), total_blocks=1000))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    long, short = dispatcher.dispatch(request(0, tokens=6000)), dispatcher.dispatch(request(1, tokens=16))
    assert long is not None and long.instance_id == "roomy"
    assert short is not None and short.instance_id == "snug"


@pytest.mark.parametrize("policy", ["round-robin", "llumnix"])
async def test_a_llumlet_whose_engine_has_not_reported_gets_no_request(policy: str) -> None:
    """Until its engine first reports, a llumlet streams a placeholder load (no memory, no block size;
    `llumlet.grpc_service`). A request is held rather than reserved against it (reserving one made
    the router divide by the block size 0 and answer 500), and goes there once the engine reports."""
    placeholder = report_from_proto(llumlet_pb2.InstanceLoad(
        instance_id="i0", freeness=-math.inf, virtual_usage=math.inf, snapshot_age_s=math.inf,
        source=source_to_proto(LoadSource.METRICS_FALLBACK), timestamp=1.0))
    instances = cluster(placeholder)
    (instance,) = instances.all()
    assert not instance.dispatchable() and not instances.dispatchable()
    dispatcher = Dispatcher(make_dispatch_policy(policy), instances)
    assert dispatcher.dispatch(request(0)) is None
    instance.observe(report("i0", sequence=2))
    chosen = dispatcher.dispatch(request(1))
    assert chosen is instance and instance.dispatchable()


async def test_a_burst_spreads_over_instances_before_any_load_shows_it() -> None:
    instances = cluster(*(report(f"i{k}") for k in range(4)))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    chosen = [dispatcher.dispatch(request(i)) for i in range(8)]
    counts = collections.Counter(c.instance_id for c in chosen if c is not None)
    assert counts == {"i0": 2, "i1": 2, "i2": 2, "i3": 2}
    # A load that lists a pending request replaces the router's estimate of it.
    first = next(i for i in instances.all() if i.instance_id == "i0")
    listed = tuple(RequestLoad(rid, 160) for rid in first.pending)
    first.observe(report("i0", waiting=listed, sequence=2))
    assert not first.pending and first.in_flight == set(r.request_id for r in listed)
    assert first.effective_load().waiting == listed
    first.release(listed[0].request_id)
    assert first.in_flight == {listed[1].request_id}


async def test_least_requests_also_counts_in_flight_requests() -> None:
    instances = cluster(report("a"), report("b"), report("c"))
    dispatcher = Dispatcher(make_dispatch_policy("least-requests"), instances)
    counts = collections.Counter(dispatcher.dispatch(request(i)).instance_id for i in range(9))  # type: ignore[union-attr]
    assert counts == {"a": 3, "b": 3, "c": 3}


async def test_busy_instances_hold_the_request_unless_one_is_idle() -> None:
    busy = (RequestLoad("x", 1500, blocks=95),)
    instances = cluster(report("a", free_blocks=5, running=busy), report("b", free_blocks=5, running=busy))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    assert dispatcher.dispatch(request(1)) is None
    # an instance with nothing to finish would never wake the queue: the request goes there
    instances.all()[1].observe(report("b", free_blocks=100, total_blocks=100, sequence=2))
    too_big = request(2, tokens=5000)
    chosen = dispatcher.dispatch(too_big)
    assert chosen is not None and chosen.instance_id == "b"


async def test_a_request_too_large_for_every_instance_goes_to_an_idle_one_not_the_best_busy_one() -> None:
    running = (RequestLoad("x", 9000, blocks=600),)
    instances = cluster(report("big", free_blocks=400, running=running, total_blocks=1000),
                        report("small", free_blocks=50, total_blocks=50))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    # 8000 tokens = 500 blocks: "big" would be 100 blocks short, "small" 450, and only "small" is idle.
    chosen = dispatcher.dispatch(request(1, tokens=8000))
    assert chosen is not None and chosen.instance_id == "small"
    # Now neither is idle: the next one is held.
    assert dispatcher.dispatch(request(2, tokens=8000)) is None


async def test_a_held_request_goes_where_a_request_ended_before_the_next_load_shows_it() -> None:
    running = (RequestLoad("x", 800, blocks=50), RequestLoad("y", 720, blocks=45))
    queues: list[DispatchQueue] = []
    instances = cluster(report("a", free_blocks=5, running=running),
                        on_change=lambda: [q.wake() for q in queues])
    a = instances.all()[0]
    a.in_flight.update({"x", "y"})
    queues.append(DispatchQueue(Dispatcher(make_dispatch_policy("llumnix"), instances), 4, timeout_s=5.0))
    held = asyncio.create_task(queues[0].acquire(request(1, tokens=480), high_priority=False))
    await wait_until(lambda: len(queues[0]) == 1, "the request held in the queue")
    assert not held.done()
    a.release("x")  # its stream ended: 50 blocks are free, the load still lists it
    assert await asyncio.wait_for(held, 1.0) is a
    assert [r.request_id for r in a.effective_load().running] == ["y"]
    # The next load no longer lists "x": nothing is subtracted twice.
    a.observe(report("a", free_blocks=55, running=running[1:], waiting=(request(1, tokens=480),), sequence=2))
    assert not a.ended and a.effective_load().free_blocks == 55


async def test_stale_and_unavailable_instances_are_skipped() -> None:
    instances = cluster(report("a"), report("b"))
    a, b = instances.all()
    dispatcher = Dispatcher(make_dispatch_policy("round-robin"), instances)
    a.mark_unavailable()
    b.last_seen -= 60.0  # no load, not even a heartbeat, for a minute
    assert dispatcher.dispatch(request(1)) is None
    a.mark_available()
    assert {dispatcher.dispatch(request(i)).instance_id for i in range(3)} == {"a"}  # type: ignore[union-attr]


async def test_queue_orders_by_priority_then_arrival_and_is_bounded() -> None:
    busy = (RequestLoad("x", 1500, blocks=95),)
    instances = cluster(report("a", free_blocks=5, running=busy))
    queue = DispatchQueue(Dispatcher(make_dispatch_policy("llumnix"), instances), capacity=3, timeout_s=5.0)
    instances.on_change = queue.wake
    served: list[str] = []

    async def wait(r: RequestLoad) -> None:
        instance = await queue.acquire(r, r.high_priority)
        served.append(r.request_id)
        instance.release(r.request_id)

    tasks = [asyncio.create_task(wait(r)) for r in (request(1), request(2), request(3, 480, high=True))]
    await wait_until(lambda: len(queue) == 3, "the three requests queued")
    assert not served
    assert queue.held_tokens() == [480, 160, 160]  # what the control loop reads, in dispatch order
    with pytest.raises(RouterError) as err:
        await queue.acquire(request(4), False)
    assert err.value.status == 503 and err.value.retry_after_s is not None
    instances.all()[0].observe(report("a", sequence=2))  # the instance emptied: the queue drains
    await asyncio.gather(*tasks)
    assert served == ["r3", "r1", "r2"]


async def test_a_held_request_that_does_not_fit_lets_smaller_ones_pass_for_a_while() -> None:
    def x(blocks: int) -> tuple[RequestLoad, ...]:
        return (RequestLoad("x", blocks * 16, blocks=blocks),)

    instances = cluster(report("a", free_blocks=5, running=x(95)))
    a = instances.all()[0]
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    queue = DispatchQueue(dispatcher, capacity=8, timeout_s=5.0)
    instances.on_change = queue.wake
    big = asyncio.create_task(queue.acquire(request(1, tokens=1280), False))  # 80 blocks
    small = asyncio.create_task(queue.acquire(request(2, tokens=160), False))  # 10 blocks
    vip = asyncio.create_task(queue.acquire(request(3, tokens=1280, high=True), True))
    later = asyncio.create_task(queue.acquire(request(4, tokens=160), False))
    await wait_until(lambda: len(queue) == 4, "the four requests held")
    # room for the small ones only, but the high-priority one is first: nothing passes it
    a.observe(report("a", free_blocks=35, running=x(65), sequence=2))
    assert queue.held_tokens() == [1280, 1280, 160, 160]
    a.observe(report("a", free_blocks=85, running=x(15), sequence=3))  # room for it, and 5 blocks
    assert await asyncio.wait_for(vip, 1.0) is a
    assert queue.held_tokens() == [1280, 160, 160]
    a.observe(report("a", free_blocks=35, running=x(65), sequence=4))  # the load does not list it yet
    a.release("r3")  # it finished: room for the small ones, not for the large one ahead of them
    assert await asyncio.wait_for(small, 1.0) is a and await asyncio.wait_for(later, 1.0) is a
    assert not big.done() and queue.held_tokens() == [1280]
    # passed for MAX_HOLD_S, a request waits in the engine's queue of the instance the policy chose
    assert dispatcher.dispatch(request(5, tokens=1280)) is None
    assert dispatcher.dispatch(request(5, tokens=1280), passed_s=MAX_HOLD_S) is a
    big.cancel()


async def test_the_high_priority_headroom_steers_requests_but_holds_none_the_engine_would_admit() -> None:
    running = (RequestLoad("vip", 160, blocks=10, high_priority=True), RequestLoad("r", 1440, blocks=90))
    instances = cluster(*(report(i, free_blocks=751, running=running, total_blocks=851) for i in "ab"))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    # Both instances keep 751 of their 851 blocks as headroom for their high-priority request, so
    # every instance is busy for a normal request; but each engine would admit it at once: no hold.
    loads = [i.effective_load() for i in instances.all()]
    decision = make_dispatch_policy("llumnix").choose(loads, request(1))
    assert decision is not None and decision.all_busy
    assert dispatcher.dispatch(request(1)) is not None
    assert dispatcher.dispatch(request(2, high=True)) is not None


async def test_a_draining_instance_with_nothing_to_finish_takes_no_held_request() -> None:
    busy = (RequestLoad("x", 1500, blocks=95),)
    parked = InstanceLoad("b", 100, 100, block_size=16, draining=True, timestamp=1.0)
    instances = cluster(report("a", free_blocks=5, running=busy),
                        LoadReport(parked, 0.0, 0.0, 0.0, LoadSource.CONNECTOR, 1))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    assert dispatcher.dispatch(request(1, tokens=5000)) is None


async def test_queue_timeout_and_cancellation_release_everything() -> None:
    instances = InstanceSet()  # no instance at all: requests wait
    queue = DispatchQueue(Dispatcher(make_dispatch_policy("llumnix"), instances), capacity=2, timeout_s=0.05)
    with pytest.raises(RouterError) as err:
        await queue.acquire(request(1), False)
    assert err.value.status == 503 and "within" in err.value.body["error"]["message"]
    assert len(queue) == 0
    queue.timeout_s = 60.0  # the next request must still be waiting when the test cancels it
    task = asyncio.create_task(queue.acquire(request(2), False))
    await wait_until(lambda: len(queue) == 1, "the request queued")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(queue) == 0


async def test_a_restarted_llumlet_with_a_new_id_and_a_removed_instance_are_no_longer_chosen() -> None:
    instances = cluster(report("old-id", free_blocks=100), report("b", free_blocks=50))
    dispatcher = Dispatcher(make_dispatch_policy("llumnix"), instances)
    a, b = instances.all()
    for free, sequence in ((10, 1), (100, 2)):  # a restarted llumlet starts its sequence again
        a.observe(LoadReport(InstanceLoad("new-id", 100, free, 16, timestamp=5.0 + sequence), 0.0, 0.0,
                             0.0, LoadSource.CONNECTOR, sequence))
        assert dispatcher.dispatch(request(sequence)) is (b if free == 10 else a)
    await instances.remove(a.address)
    assert {dispatcher.dispatch(request(i)) for i in range(3, 6)} == {b}
    await instances.close()


@pytest.mark.parametrize("name", ["llumnix", "infaas++", "least-requests", "round-robin"])
async def test_dispatch_chooses_as_the_policy_does_over_every_effective_load(name: str) -> None:
    """Loads arrive (listing some of the requests dispatched there), requests are dispatched and
    released in random order; every decision is the one the straightforward picker makes over the
    effective loads of the dispatchable instances."""
    rng = random.Random(name)
    policy = make_dispatch_policy(name, rng=random.Random(1))
    reference = make_dispatch_policy(name, rng=random.Random(1))
    instances = InstanceSet()
    in_flight: dict[str, tuple[Instance, RequestLoad]] = {}
    sequence = itertools.count(1)

    def new_load(instance: Instance, instance_id: str) -> None:
        listed = tuple(r for i, r in in_flight.values() if i is instance and rng.random() < 0.7)
        load = random_load(rng, instance_id)
        instance.observe(LoadReport(replace(load, waiting=load.waiting + listed, timestamp=next(sequence)),
                                    0.0, 0.0, 0.0, LoadSource.CONNECTOR, next(sequence)))

    for k in range(8):
        new_load(instances.add(f"127.0.0.1:{k + 1}", watch=False), f"i{k}")
    dispatcher = Dispatcher(policy, instances)
    for n in range(400):
        step = rng.random()
        if step < 0.3:
            k = rng.randrange(len(instances))
            new_load(instances.all()[k], f"i{k}")
        elif step < 0.5 and in_flight:
            instance, r = in_flight.pop(rng.choice(sorted(in_flight)))
            instance.release(r.request_id)
        else:
            r = random_request(rng, f"n{n}")
            candidates = instances.dispatchable()
            loads = [i.effective_load() for i in candidates]
            idle = [i for i in candidates if i.is_idle() and not i.effective_load().draining]
            queues_at = {load.instance_id: engine_queues(load, r) for load in loads}
            chosen = dispatcher.dispatch(r)
            if isinstance(reference, ScoringPolicy):
                expected = reference_choice(reference, loads, r, reference.rng)
            else:
                decision = reference.choose(loads, r)
                expected = decision and (decision.instance_id, decision.all_busy)
            if expected is None:
                assert chosen is None
            else:
                by_id = {i.instance_id: i for i in candidates}
                if expected[1] and queues_at[expected[0]] and not by_id[expected[0]].is_idle():
                    assert chosen in idle if idle else chosen is None
                else:
                    assert chosen is by_id[expected[0]]
            if chosen is not None:
                in_flight[r.request_id] = (chosen, r)
    await instances.close()


async def test_the_prefix_lookup_keys_on_the_cache_salt_and_never_credits_multimodal_prompts() -> None:
    # a caches the salted prefix but has less free memory than b: only a request that will find the
    # prefix there (same tokens, same salt) is worth sending to a.
    instances = cluster(report("a", free_blocks=60), report("b", free_blocks=100))
    a, b = instances.all()
    prompts = PromptTokens(served_model="tiny")
    prefix = list(range(16 * 40))
    instances.prefix_index.apply("a", block_hashes(prefix, 16, root_hash("tenant-a")), ())
    dispatcher = Dispatcher(make_dispatch_policy("llumnix", prefix_weight=2.0), instances, prompt_ids=prompts)

    def dispatch(i: int, endpoint: EndpointKind, body: dict[str, object]) -> Instance | None:
        ids = prompts(endpoint, body)
        load = RequestLoad(f"r{i}", max(len(ids), 660), prompt_token_ids=ids, prefix_root=prompts.root(body))
        chosen = dispatcher.dispatch(load)
        assert chosen is not None
        chosen.release(load.request_id)
        return chosen

    completion = {"model": "tiny", "prompt": [*prefix, *range(20)]}
    assert dispatch(1, EndpointKind.COMPLETION, {**completion, "cache_salt": "tenant-a"}) is a
    assert dispatch(2, EndpointKind.COMPLETION, {**completion, "cache_salt": "tenant-b"}) is b
    assert dispatch(3, EndpointKind.COMPLETION, completion) is b
    # Same token ids as prompt embeddings, or an image in a chat: no credit, dispatched by load.
    assert dispatch(4, EndpointKind.COMPLETION, {**completion, "cache_salt": "tenant-a",
                                                 "prompt_embeds": "AAAA"}) is b
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert dispatch(5, EndpointKind.CHAT, {"model": "tiny", "messages": image, "cache_salt": "tenant-a"}) is b
    await instances.close()
