"""The dispatch picker over a ranking kept one load at a time makes the choices of the straightforward
picker that scores every instance (`dispatch_reference`), on random loads, ties and near-ties."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from dispatch_reference import random_load, random_loads, random_request, reference_choice, reference_top

from llumnix.load import InstanceLoad
from llumnix.policies.dispatch import ScoringPolicy, make_dispatch_policy

SCORING = ("llumnix", "infaas++", "least-requests")


def scoring_policy(name: str, seed: int, top_k: int = 1, busy_freeness: float = 0.0) -> ScoringPolicy:
    policy = make_dispatch_policy(name, top_k=top_k, busy_freeness=busy_freeness, rng=random.Random(seed))
    assert isinstance(policy, ScoringPolicy)
    return policy


@pytest.mark.parametrize("name", SCORING)
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("scale", [1, 10**8])
def test_choices_over_a_changing_ranking_match_scoring_every_instance(name: str, top_k: int, scale: int
                                                                      ) -> None:
    rng = random.Random(f"{name}-{top_k}-{scale}")
    for trial in range(30):
        policy = scoring_policy(name, trial, top_k, busy_freeness=rng.choice([0.0, 3.0, -50.0]))
        reference_rng = random.Random(trial)
        loads = {load.instance_id: load for load in random_loads(rng, rng.randint(1, 12), scale)}
        ranking = policy.ranking()
        for load in loads.values():
            ranking.update(load)
        for step in range(25):
            request = None if rng.random() < 0.1 else random_request(rng)
            decision = ranking.choose(request)
            expected = reference_choice(policy, list(loads.values()), request, reference_rng)
            assert (decision and (decision.instance_id, decision.all_busy)) == expected, (trial, step)
            change = rng.random()
            if change < 0.15 and loads:
                gone = rng.choice(sorted(loads))
                del loads[gone]
                ranking.discard(gone)
            elif change < 0.3:
                instance_id = rng.choice([*loads, f"new{step}"])
                copy_of = rng.choice([*loads.values(), None])
                loads[instance_id] = random_load(rng, instance_id, scale) if copy_of is None else \
                    InstanceLoad(instance_id, copy_of.total_blocks, copy_of.free_blocks, copy_of.block_size,
                                 copy_of.running, copy_of.waiting, copy_of.draining)
                ranking.update(loads[instance_id])
            elif decision is not None:
                # The chosen instance got the request (what the router's pending accounting does).
                chosen = loads[decision.instance_id]
                queued = chosen.waiting + (() if request is None else (request,))
                loads[chosen.instance_id] = InstanceLoad(chosen.instance_id, chosen.total_blocks,
                                                         chosen.free_blocks, chosen.block_size,
                                                         chosen.running, queued)
                ranking.update(loads[chosen.instance_id])


@pytest.mark.parametrize("name", SCORING)
def test_one_choice_over_a_list_matches_scoring_every_instance(name: str) -> None:
    rng = random.Random(5)
    for trial in range(300):
        policy = scoring_policy(name, trial, top_k=rng.choice([1, 1, 2]))
        loads = random_loads(rng, rng.randint(0, 10), scale=rng.choice([1, 10**8]))
        request = random_request(rng)
        decision = policy.choose(loads, request)
        expected = reference_choice(policy, loads, request, random.Random(trial))
        assert (decision and (decision.instance_id, decision.all_busy)) == expected


def test_near_ties_among_peers_are_ties() -> None:
    # Rooms one block apart at 10^10 blocks: freeness within the tie tolerance, not equal.
    loads = [InstanceLoad(f"i{k}", 10**10, 10**10 - k, 16) for k in range(3)]
    loads.append(InstanceLoad("far", 10**10, 10**10 - 10**6, 16))
    policy = scoring_policy("llumnix", 0)
    request = random_request(random.Random(1))
    picks = Counter(policy.choose(loads, request).instance_id for _ in range(300))  # type: ignore[union-attr]
    assert set(picks) == {"i0", "i1", "i2"}
    assert reference_top(policy, loads, request) == (["i0", "i1", "i2"], False)


@pytest.mark.parametrize("name", SCORING)
@pytest.mark.parametrize("top_k", [1, 2])
def test_ineligible_instances_are_passed_over_and_the_rest_stay_equally_likely(name: str, top_k: int
                                                                                ) -> None:
    rng = random.Random(8)
    for trial in range(100):
        policy = scoring_policy(name, trial, top_k)
        loads = random_loads(rng, rng.randint(1, 10))
        ranking = policy.ranking()
        for load in loads:
            ranking.update(load)
        ineligible = {load.instance_id for load in loads if rng.random() < 0.3}
        request = random_request(rng)
        decision = ranking.choose(request, lambda iid: iid not in ineligible)  # noqa: B023
        expected = reference_top(policy, [x for x in loads if x.instance_id not in ineligible], request)
        if expected is None:
            assert decision is None
        else:
            assert decision is not None and decision.all_busy == expected[1]
            assert decision.instance_id in expected[0]
    # Three tied instances, the best-placed one ineligible: the other two are chosen equally often.
    loads = [InstanceLoad(iid, 100, 100, 16) for iid in ("a", "b", "c")]
    ranking = scoring_policy(name, 0, top_k).ranking()
    for load in loads:
        ranking.update(load)
    picks = Counter(ranking.choose(random_request(rng), lambda iid: iid != "a").instance_id  # type: ignore[union-attr]
                    for _ in range(2000))
    assert set(picks) == {"b", "c"} and abs(picks["b"] - picks["c"]) < 200


def test_round_robin_over_a_changing_ranking_keeps_its_cycle() -> None:
    policy = make_dispatch_policy("round-robin")
    ranking = policy.ranking()
    for iid in ("c", "a", "b"):
        ranking.update(InstanceLoad(iid, 100, 100))
    assert [ranking.choose().instance_id for _ in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]
    ranking.update(InstanceLoad("b", 100, 100, draining=True))
    ranking.update(InstanceLoad("d", 100, 100))
    assert [ranking.choose().instance_id for _ in range(3)] == ["c", "d", "a"]  # type: ignore[union-attr]
    ranking.discard("c")
    assert ranking.choose(eligible=lambda iid: iid != "d").instance_id == "a"  # type: ignore[union-attr]
    assert ranking.choose(eligible=lambda iid: False) is None
    # The list form shares the cursor.
    assert policy.choose([InstanceLoad(iid, 100, 100) for iid in "abc"]).instance_id == "b"  # type: ignore[union-attr]
