"""The per-snapshot aggregates of `InstanceLoad` and what dispatch relies on, checked on random loads
against the definitions written out here."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from dispatch_reference import random_load, random_request

from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    InstanceLoad,
    LoadModelConfig,
    RequestLoad,
    dispatch_freeness,
    dispatch_peers,
    memory_load,
    queued_demand,
    with_pending,
    without_requests,
)
from llumnix.policies.dispatch import NO_TOKENS

CONFIGS = (DEFAULT_LOAD_MODEL, LoadModelConfig(high_priority_target_tokens=320))


def blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def expected_queued_blocks(load: InstanceLoad) -> int:
    return sum(blocks(r.prompt_tokens + r.output_tokens, load.block_size) for r in load.waiting)


def expected_high_priority(load: InstanceLoad) -> bool:
    return any(r.high_priority for r in (*load.running, *load.waiting))


def expected_dispatch_freeness(load: InstanceLoad, request: RequestLoad | None, config: LoadModelConfig
                               ) -> float:
    """The definition, summed over the whole queue on every call."""
    if load.draining:
        return -math.inf
    queued = [*load.waiting] + ([] if request is None else [request])
    demand = sum(blocks(r.prompt_tokens + r.output_tokens, load.block_size) for r in queued)
    high = expected_high_priority(load) or (request is not None and request.high_priority)
    headroom = max(0, load.total_blocks - blocks(config.high_priority_target_tokens, load.block_size)) \
        if high else 0
    room = load.free_blocks - load.reserved_blocks - demand - headroom
    if room < 0:
        return float(room)
    return room / max(1, len(load.running) + len(queued))


def variants(load: InstanceLoad, rng: random.Random) -> list[InstanceLoad]:
    """The load as the router derives it: with requests dispatched there, without ended ones."""
    pending = [random_request(rng, f"p{i}") for i in range(rng.randint(1, 3))]
    ended = {r.request_id for r in rng.sample([*load.running, *load.waiting],
                                              min(2, load.num_requests))}
    return [with_pending(load, pending), without_requests(load, ended),
            without_requests(with_pending(load, pending), ended | {pending[0].request_id}),
            replace(load, waiting=load.waiting[1:])]


def test_the_cached_aggregates_match_their_definition() -> None:
    rng = random.Random(11)
    for n in range(500):
        for load in (base := random_load(rng, f"i{n}")), *variants(base, rng):
            assert load.queued_blocks == queued_demand(load) == expected_queued_blocks(load)
            assert load.has_high_priority == expected_high_priority(load)
            assert memory_load(load) == (math.inf if load.draining else (
                load.used_blocks + load.reserved_blocks + expected_queued_blocks(load)) / load.total_blocks)


def test_the_cached_aggregates_leave_equality_and_repr_alone() -> None:
    load = random_load(random.Random(2), "a")
    assert load == replace(load) and hash(load) == hash(replace(load))
    assert "queued_blocks" not in repr(load)


def test_dispatch_freeness_matches_its_definition() -> None:
    rng = random.Random(12)
    for n in range(500):
        for load in (base := random_load(rng, f"i{n}")), *variants(base, rng):
            for config in CONFIGS:
                for request in (None, random_request(rng), random_request(rng)):
                    assert dispatch_freeness(load, request, config) == \
                        expected_dispatch_freeness(load, request, config)


def test_no_request_makes_an_instance_freer_than_one_without_tokens() -> None:
    rng = random.Random(13)
    for n in range(2000):
        load = random_load(rng, f"i{n}")
        request = random_request(rng)
        assert dispatch_freeness(load, request) <= dispatch_freeness(load, NO_TOKENS)


def peer_of(load: InstanceLoad, rng: random.Random) -> InstanceLoad:
    """Another room, the same peers: other free and reserved blocks, other queued sizes."""
    waiting = tuple(replace(r, prompt_tokens=rng.randint(1, 3000)) for r in load.waiting)
    return replace(load, instance_id="peer", free_blocks=rng.randint(0, load.total_blocks),
                   reserved_blocks=rng.choice([0, rng.randint(0, 40)]), waiting=waiting)


def test_peers_score_in_the_order_of_their_bounds_and_at_least_as_far_apart() -> None:
    rng = random.Random(14)
    for n in range(3000):
        a = random_load(rng, f"i{n}", scale=rng.choice([1, 1, 10**8]))
        b = peer_of(a, rng)
        assert dispatch_peers(a) == dispatch_peers(b)
        if a.draining:
            continue
        for config in CONFIGS:
            bound_a, bound_b = (dispatch_freeness(x, NO_TOKENS, config) for x in (a, b))
            if bound_a < bound_b:
                a, b, bound_a, bound_b = b, a, bound_b, bound_a
            request = random_request(rng)
            score_a, score_b = (dispatch_freeness(x, request, config) for x in (a, b))
            if bound_a == bound_b:
                assert score_a == score_b
            else:
                slack = 1e-12 * max(1.0, abs(score_a), abs(score_b))  # float rounding
                assert score_a - score_b >= bound_a - bound_b - slack
