"""Prefix-cache aware dispatch: the cached blocks of a request compose with freeness
(`prefix_freeness`), and the ranking's fast path still makes the choices of scoring every instance."""

from __future__ import annotations

import random

import pytest
from dispatch_reference import random_loads, random_request

from llumnix.load import InstanceLoad, RequestLoad, dispatch_freeness
from llumnix.policies.dispatch import ScoringPolicy, make_dispatch_policy, prefix_freeness


def load(instance_id: str, free: int, running: int = 1, total: int = 1000) -> InstanceLoad:
    requests = tuple(RequestLoad(f"{instance_id}-{i}", 100, 10, blocks=1) for i in range(running))
    return InstanceLoad(instance_id, total, free, 16, requests)


PROMPT = RequestLoad("new", 1600, 0)  # 100 blocks


def test_cached_blocks_are_blocks_the_request_does_not_need() -> None:
    a = load("a", 500)
    assert dispatch_freeness(a, PROMPT, cached_blocks=60) == (500 - 40) / 2
    assert dispatch_freeness(a, PROMPT, cached_blocks=500) == 500 / 2  # never below no demand


def test_a_hit_wins_over_more_headroom_up_to_its_share_of_the_prompt() -> None:
    policy = make_dispatch_policy("llumnix")
    hit, free = load("hit", 400), load("free", 600)
    assert policy.choose([hit, free], PROMPT).instance_id == "free"
    assert policy.choose([hit, free], PROMPT, {"hit": 90}).instance_id == "hit"
    # Weight 2, 90% cached: the hit's headroom counts 2.8x; 3x the headroom elsewhere still wins.
    assert policy.choose([hit, load("roomy", 1000, running=0, total=4000)], PROMPT, {"hit": 90}
                         ).instance_id == "roomy"


def test_a_hit_never_makes_a_busy_instance_free() -> None:
    busy = load("busy", 50)
    assert dispatch_freeness(busy, PROMPT) < 0
    assert prefix_freeness(busy, PROMPT, 10, weight=5.0) == dispatch_freeness(busy, PROMPT, cached_blocks=10)
    free = load("free", 300)
    for weight in (0.5, 2.0, 10.0):
        policy = make_dispatch_policy("llumnix", prefix_weight=weight, busy_freeness=3.0)
        decision = policy.choose([load("busy", 80), free], PROMPT, {"busy": 20})
        assert decision.instance_id == "free" and not decision.all_busy


def test_weight_zero_ignores_caches() -> None:
    policy = make_dispatch_policy("llumnix", prefix_weight=0.0)
    assert policy.choose([load("hit", 400), load("free", 600)], PROMPT, {"hit": 99}).instance_id == "free"
    with pytest.raises(ValueError):
        make_dispatch_policy("llumnix", prefix_weight=-1.0)


def _reference(policy: ScoringPolicy, loads: list[InstanceLoad], request: RequestLoad | None,
               cached: dict[str, float]) -> tuple[list[str], bool] | None:
    scored = [(policy.score_cached(x, request, cached.get(x.instance_id, 0)), x.instance_id)
              for x in loads if not x.draining]
    if not scored:
        return None
    free = [item for item in scored if not policy.is_busy(item[0])]
    candidates = free or scored
    best = max(score for score, _ in candidates)
    tolerance = 1e-9 * max(1, abs(best))
    return sorted(i for s, i in candidates if abs(s - best) <= tolerance), not free


@pytest.mark.parametrize("weight", [0.5, 2.0, 8.0])
def test_the_fast_path_chooses_what_scoring_every_instance_chooses(weight: float) -> None:
    rng = random.Random(weight)
    for trial in range(300):
        policy = make_dispatch_policy("llumnix", prefix_weight=weight, busy_freeness=rng.choice([0.0, 3.0]),
                                      rng=random.Random(trial))
        assert isinstance(policy, ScoringPolicy)
        loads = random_loads(rng, rng.randint(1, 10))
        request = random_request(rng)
        cached = {x.instance_id: float(rng.randint(1, 60)) for x in loads if rng.random() < 0.3}
        expected = _reference(policy, loads, request, cached)
        ranking = policy.ranking()
        for x in loads:
            ranking.update(x)
        decision = ranking.choose(request, cached=cached)
        if expected is None:
            assert decision is None
            continue
        assert decision is not None and decision.instance_id in expected[0], trial
        assert decision.all_busy == expected[1], trial
