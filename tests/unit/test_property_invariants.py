"""Property tests (hypothesis) of the invariants the rest of the system leans on: the load model,
the three policies, the wire conversions and the router's request parsing. Each property is one
sentence a caller relies on; hypothesis searches for a counterexample and shrinks it."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llumnix.held_demand import held_demand_from_bytes, held_demand_to_bytes
from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    ClusterDemand,
    InstanceLoad,
    RequestLoad,
    aggregate_freeness,
    dispatch_freeness,
    dispatch_peers,
    freeness,
    virtual_usage,
    without_requests,
)
from llumnix.openai_request import OpenAIRequestError
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage
from llumnix.policies.autoscaling import AutoscalingConfig, decide
from llumnix.policies.dispatch import (
    NO_TOKENS,
    POLICY_NAMES,
    ScoringPolicy,
    make_dispatch_policy,
    prefix_freeness,
    queue_freeness,
)
from llumnix.policies.migration import MigrationConfig, admits, fits, is_source, pair_migrations
from llumnix.router.client_request import PrioritySettings, RequestLimits, parse_client_request
from llumnix.wire import (
    LoadReport,
    LoadSource,
    chunk_from_proto,
    chunk_to_proto,
    report_from_proto,
    report_to_proto,
)

settings.register_profile(
    "llumnix", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("llumnix")

UINT32 = 2**32 - 1
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def requests(draw: st.DrawFn, request_id: str, running: bool, block_size: int) -> RequestLoad:
    prompt = draw(st.integers(1, 4096))
    output = draw(st.integers(0, 2048)) if running else 0
    blocks = -(-(prompt + output) // block_size) if running else 0
    return RequestLoad(
        request_id,
        prompt,
        output,
        blocks,
        high_priority=draw(st.booleans()),
        arrival_time=draw(st.floats(0, 1e6)),
        migrating=running and draw(st.booleans()),
    )


@st.composite
def instance_loads(draw: st.DrawFn, instance_id: str = "i0", draining: bool | None = None) -> InstanceLoad:
    """A snapshot an engine could report: the running requests' blocks are held, reservations come
    out of the free blocks."""
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    running = tuple(
        draw(requests(f"{instance_id}-r{n}", True, block_size)) for n in range(draw(st.integers(0, 6)))
    )
    waiting = tuple(
        draw(requests(f"{instance_id}-w{n}", False, block_size)) for n in range(draw(st.integers(0, 4)))
    )
    held = sum(r.blocks for r in running)
    total = held + draw(st.integers(1, 4096))
    free = total - held - draw(st.integers(0, total - held))
    reserved = draw(st.integers(0, free))
    return InstanceLoad(
        instance_id,
        total,
        free,
        block_size,
        running,
        waiting,
        draining=draw(st.booleans()) if draining is None else draining,
        preemptions=draw(st.integers(0, 3)),
        migrating_out=draw(st.integers(0, 1)),
        migrating_in=draw(st.integers(0, 1)),
        reserved_blocks=reserved,
        timestamp=draw(st.floats(0, 1e9)),
    )


@st.composite
def clusters(draw: st.DrawFn, max_size: int = 8) -> list[InstanceLoad]:
    return [draw(instance_loads(f"i{n}")) for n in range(draw(st.integers(0, max_size)))]


new_requests = st.builds(
    RequestLoad, st.just("new"), st.integers(0, 8192), st.integers(0, 1024), high_priority=st.booleans()
)


# --- the load model ------------------------------------------------------------------------------


@given(instance_loads(draining=False), st.integers(0, 4096), st.none() | new_requests)
def test_freeness_is_monotone_in_free_blocks(
    load: InstanceLoad, more: int, request: RequestLoad | None
) -> None:
    freer = replace(load, total_blocks=load.total_blocks + more, free_blocks=load.free_blocks + more)
    assert freeness(freer) >= freeness(load)
    assert dispatch_freeness(freer, request) >= dispatch_freeness(load, request)


@given(instance_loads(draining=False), new_requests, st.integers(1, 4096))
def test_a_longer_request_never_makes_an_instance_look_freer(
    load: InstanceLoad, request: RequestLoad, extra: int
) -> None:
    longer = replace(request, prompt_tokens=request.prompt_tokens + extra)
    assert dispatch_freeness(load, longer) <= dispatch_freeness(load, request)
    assert dispatch_freeness(load, request) <= dispatch_freeness(load, NO_TOKENS)


@given(instance_loads(draining=False), new_requests, st.data())
def test_peers_keep_their_order_for_every_request(
    a: InstanceLoad, request: RequestLoad, data: st.DataObject
) -> None:
    # What the dispatch picker's skipping relies on (see `dispatch_peers`): `b` is a peer of `a` (same
    # requests, priorities, memory and block size) whose memory is used and queued differently.
    held = sum(r.blocks for r in a.running)
    free = data.draw(st.integers(0, a.total_blocks - held))
    waiting = tuple(replace(r, prompt_tokens=data.draw(st.integers(1, 4096))) for r in a.waiting)
    b = replace(
        a,
        instance_id="i1",
        free_blocks=free,
        reserved_blocks=data.draw(st.integers(0, free)),
        waiting=waiting,
    )
    assert dispatch_peers(a) == dispatch_peers(b)
    if dispatch_freeness(a, NO_TOKENS) >= dispatch_freeness(b, NO_TOKENS):
        a, b = b, a
    bound_gap = dispatch_freeness(b, NO_TOKENS) - dispatch_freeness(a, NO_TOKENS)
    assert dispatch_freeness(b, request) - dispatch_freeness(a, request) >= bound_gap - 1e-9


@given(instance_loads())
def test_usage_covers_what_is_held_and_draining_is_never_free(load: InstanceLoad) -> None:
    if load.draining:
        assert freeness(load) == -math.inf and dispatch_freeness(load) == -math.inf
    else:
        assert virtual_usage(load) >= load.used_blocks + load.reserved_blocks
        assert math.isfinite(freeness(load))


@given(clusters(), instance_loads("drained", draining=True))
def test_draining_instances_do_not_change_the_aggregate(
    loads: list[InstanceLoad], drained: InstanceLoad
) -> None:
    assert aggregate_freeness([*loads, drained]) == aggregate_freeness(loads)


@given(instance_loads(), st.data())
def test_ending_requests_frees_their_blocks_and_nothing_more(load: InstanceLoad, data: st.DataObject) -> None:
    ids = [r.request_id for r in (*load.running, *load.waiting)]
    ended = set(data.draw(st.lists(st.sampled_from(ids), unique=True))) if ids else set()
    after = without_requests(load, ended)
    assert after.free_blocks <= after.total_blocks
    assert not {r.request_id for r in (*after.running, *after.waiting)} & ended
    assert after.free_blocks == min(
        load.total_blocks, load.free_blocks + sum(r.blocks for r in load.running if r.request_id in ended)
    )


# --- the policies --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(loads=clusters(), request=st.none() | new_requests, seed=st.integers(0, 2**16), data=st.data())
def test_dispatch_never_picks_a_draining_or_ineligible_instance(
    policy_name: str, loads: list[InstanceLoad], request: RequestLoad | None, seed: int, data: st.DataObject
) -> None:
    policy = make_dispatch_policy(policy_name, rng=random.Random(seed))
    ranking = policy.ranking()
    for load in loads:
        ranking.update(load)
    ids = [load.instance_id for load in loads]
    excluded = set(data.draw(st.lists(st.sampled_from(ids), unique=True))) if ids else set()
    decision = ranking.choose(request, lambda instance_id: instance_id not in excluded)
    candidates = [load for load in loads if not load.draining and load.instance_id not in excluded]
    if not candidates:
        assert decision is None
        return
    assert decision is not None
    assert decision.instance_id in {load.instance_id for load in candidates}


@given(loads=clusters(), request=st.none() | new_requests, seed=st.integers(0, 2**16), data=st.data())
def test_llumnix_dispatch_picks_the_best_score_and_a_kept_ranking_agrees_with_a_fresh_one(
    loads: list[InstanceLoad], request: RequestLoad | None, seed: int, data: st.DataObject
) -> None:
    # Instances holding part of the prompt in their prefix cache are scored with the hit; the others
    # are walked in the order of a bound that does not cover a hit.
    policy = make_dispatch_policy("llumnix", rng=random.Random(seed))
    assert isinstance(policy, ScoringPolicy)
    ids = [x.instance_id for x in loads]
    cached = (
        data.draw(st.dictionaries(st.sampled_from(ids), st.integers(1, 300), max_size=len(ids)))
        if ids
        else {}
    )
    kept = policy.ranking()
    for load in loads:  # stale loads first, then the current ones, then some instances leave
        kept.update(replace(load, free_blocks=0, reserved_blocks=0))
    for load in loads:
        kept.update(load)
    gone = set(data.draw(st.lists(st.sampled_from(ids), unique=True))) if ids else set()
    for instance_id in gone:
        kept.discard(instance_id)
    present = [load for load in loads if load.instance_id not in gone]
    decision = kept.choose(request, cached=cached)
    serving = [load for load in present if not load.draining]
    if not serving:
        assert decision is None
        return

    def score(load: InstanceLoad) -> float:
        return policy.score_cached(load, request, cached.get(load.instance_id, 0))

    assert decision is not None
    best = max(score(load) for load in serving)
    chosen = next(load for load in serving if load.instance_id == decision.instance_id)
    assert math.isclose(score(chosen), best, rel_tol=1e-9, abs_tol=1e-9)
    assert decision.all_busy == (best < 0)
    fresh = policy.choose(present, request, cached=cached)
    assert fresh is not None
    fresh_load = next(load for load in serving if load.instance_id == fresh.instance_id)
    assert math.isclose(score(fresh_load), best, rel_tol=1e-9, abs_tol=1e-9)


@given(instance_loads(draining=False), new_requests, st.integers(1, 300), st.floats(0, 8), st.floats(-5, 5))
def test_a_cache_hit_never_hurts_and_never_makes_a_busy_instance_free(
    load: InstanceLoad, request: RequestLoad, cached_blocks: int, weight: float, busy: float
) -> None:
    with_hit = prefix_freeness(load, request, cached_blocks, weight, busy)
    without = queue_freeness(load, request, busy_freeness=busy)
    assert with_hit >= without - 1e-9
    assert (with_hit < busy) == (dispatch_freeness(load, request, cached_blocks=cached_blocks) < busy)


@given(clusters(), st.floats(0, 20), st.integers(1, 2))
def test_migration_pairs_go_from_loaded_to_free_and_never_share_an_instance(
    loads: list[InstanceLoad], threshold: float, concurrency: int
) -> None:
    config = MigrationConfig.with_threshold(threshold, max_concurrent_per_instance=concurrency)
    by_id = {load.instance_id: load for load in loads}
    pairs = pair_migrations(loads, config)
    ends = [p.source for p in pairs] + [p.destination for p in pairs]
    assert len(ends) == len(set(ends))
    for pair in pairs:
        source, destination = by_id[pair.source], by_id[pair.destination]
        assert is_source(source, config, DEFAULT_LOAD_MODEL)
        assert not destination.draining
        assert freeness(destination) >= config.destination_freeness
        assert freeness(destination) > freeness(source)
        for load in (source, destination):
            assert load.migrating_in + load.migrating_out < config.max_concurrent_per_instance


@given(instance_loads("src", draining=False), instance_loads("dst"))
def test_a_destination_admits_only_what_fits_and_leaves_it_free(
    source: InstanceLoad, destination: InstanceLoad
) -> None:
    assume(source.running)
    request = source.running[0]
    config = MigrationConfig()
    if admits(request, destination, config):
        assert fits(request, destination) and not destination.draining
        taken = replace(
            destination,
            free_blocks=destination.free_blocks - request.blocks,
            running=(*destination.running, request),
        )
        assert freeness(taken) >= config.destination_freeness


demands = st.builds(ClusterDemand, st.floats(0, 1e6), st.integers(0, 10_000))


@given(clusters(), st.integers(0, 3), st.integers(0, 4), st.integers(1, 10), st.none() | demands)
def test_autoscaling_stays_within_its_bounds(
    loads: list[InstanceLoad], starting: int, min_instances: int, extra: int, previous: ClusterDemand | None
) -> None:
    config = AutoscalingConfig(min_instances=min_instances, max_instances=min_instances + extra)
    action = decide(loads, starting, config, previous=previous)
    serving = [load for load in loads if not load.draining]
    by_id = {load.instance_id: load for load in loads}
    if action.kind == "scale-up":
        assert action.starts >= 1
        assert len(serving) + starting + action.starts <= config.max_instances
    elif action.kind == "drain":
        assert action.instance_id in {load.instance_id for load in serving}
        assert len(serving) > max(1, config.min_instances) and starting == 0
    elif action.kind in ("release", "cancel-drain"):
        assert by_id[action.instance_id].draining
        if action.kind == "release":
            assert by_id[action.instance_id].num_requests == 0
    else:
        assert action.kind == "none"


held_requests = st.lists(st.integers(1, 100_000), min_size=1, max_size=20)


@given(clusters(), st.integers(0, 3), st.none() | demands, held_requests)
def test_requests_held_by_the_routers_never_make_the_service_smaller(
    loads: list[InstanceLoad], starting: int, previous: ClusterDemand | None, held: list[int]
) -> None:
    config = AutoscalingConfig(min_instances=1, max_instances=64)
    without = decide(loads, starting, config, previous=previous)
    with_held = decide(loads, starting, config, previous=previous, held_tokens=held)
    if with_held.kind == "drain":
        assert without.kind == "drain"
    if without.kind in ("scale-up", "cancel-drain"):
        assert with_held.kind == without.kind and with_held.starts >= without.starts


# --- the wire ------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**32 - 1), max_size=100))
def test_held_demand_survives_the_wire(tokens: list[int]) -> None:
    assert held_demand_from_bytes(held_demand_to_bytes(tokens)) == tokens


def test_held_demand_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a HeldDemand"):
        held_demand_from_bytes(b"\xff\xff\xff")


@given(
    instance_loads(),
    st.one_of(finite, st.just(-math.inf)),
    st.one_of(finite, st.just(math.inf)),
    st.floats(0, 1e6),
    st.sampled_from(list(LoadSource)),
    st.integers(0, 2**64 - 1),
)
def test_a_load_report_survives_the_wire(
    load: InstanceLoad, free: float, usage: float, age: float, source: LoadSource, sequence: int
) -> None:
    report = LoadReport(load, free, usage, age, source, sequence)
    assert (
        report_from_proto(
            type(report_to_proto(report)).FromString(report_to_proto(report).SerializeToString())
        )
        == report
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(0, UINT32), max_size=8).map(tuple)


@given(
    st.builds(
        GenerationChunk,
        index=st.integers(0, UINT32),
        token_ids=token_ids,
        text=st.text(),
        finish_reason=st.none() | st.sampled_from(["stop", "length", "abort"]),
        stop_reason=st.none() | st.integers(-(2**53), 2**53) | st.text(max_size=10),
        prompt_token_ids=token_ids,
        model=st.text(max_size=10),
        # Each half of uint32, so that the total (a uint32 on the wire) fits too.
        usage=st.none() | st.builds(Usage, st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
        role=st.sampled_from(["", "assistant"]),
        logprobs=st.none() | st.dictionaries(st.text(max_size=8), json_values),
        extra_delta=st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=3),
    )
)
def test_a_chunk_survives_the_wire(chunk: GenerationChunk) -> None:
    msg = chunk_to_proto(chunk)
    again = chunk_from_proto(type(msg).FromString(msg.SerializeToString()))
    # JSON fields compare as JSON (a float that is integral may come back as an int, NaN never goes).
    assert orjson.dumps(again.logprobs) == orjson.dumps(chunk.logprobs)
    assert orjson.dumps(again.extra_delta) == orjson.dumps(chunk.extra_delta)
    assert replace(again, logprobs=None, extra_delta={}) == replace(chunk, logprobs=None, extra_delta={})


# --- the router's request parsing ----------------------------------------------------------------

limit_values = st.integers(-2, 2) | st.sampled_from([4095, 4096, 4097, True]) | json_values  # the bounds
knobs = {
    "max_tokens": limit_values,
    "max_completion_tokens": limit_values,
    "priority": st.sampled_from(["high", "low", "normal", "urgent", 1, None]),
    "stream": json_values,
}
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", 3])}, optional={"content": json_values | st.text()}
    ),
    max_size=3,
)
bodies = st.one_of(
    json_values,  # anything at all
    st.fixed_dictionaries({}, optional={"prompt": json_values, "messages": json_values, **knobs}),
    # well-formed enough to reach the limits
    st.fixed_dictionaries(
        {
            "prompt": st.text(min_size=1)
            | st.lists(st.integers(-5, 70000), min_size=1)
            | st.lists(st.text() | st.lists(st.integers(0, 9), max_size=2), min_size=1, max_size=3)
        },
        optional=knobs,
    ),
    st.fixed_dictionaries({"messages": messages}, optional=knobs),
)


@settings(max_examples=500)
@given(st.sampled_from(list(EndpointKind)), bodies, st.sampled_from(["", "high", "HIGH", "bogus"]))
def test_request_parsing_accepts_or_refuses_with_a_client_error(
    endpoint: EndpointKind, body: object, priority_header: str
) -> None:
    limits = RequestLimits(max_tokens=4096, max_prompt_tokens=2048)
    priorities = PrioritySettings()
    try:
        request = parse_client_request(
            endpoint, body, {priorities.header: priority_header}, limits, priorities
        )
    except OpenAIRequestError as exc:
        assert 400 <= exc.status < 500
        assert set(orjson.loads(exc.response().body)["error"]) >= {"message", "type"}
        return
    assert isinstance(body, dict)
    assert request.prompt_tokens_estimate >= 1
    assert not isinstance(request.body.get(priorities.body_field), str)  # the router's own field is removed
    for key in ("max_tokens", "max_completion_tokens"):
        value = request.body.get(key)
        assert value is None or (type(value) is int and 1 <= value <= limits.max_tokens)
    assert request.high_priority == (
        priority_header.lower() == "high" or body.get(priorities.body_field) == "high"
    )
