"""Autoscaling decisions: hand-computed aggregate freeness against the bounds."""

from dataclasses import replace

import pytest

from llumnix.load import ClusterDemand, InstanceLoad, RequestLoad, aggregate_freeness, cluster_demand
from llumnix.policies.autoscaling import (
    AutoscalingConfig,
    decide,
    drain_candidate,
    drained_empty,
    projected_demand,
    release_due,
    reuse_order,
)

CFG = AutoscalingConfig(scale_up_below=10, scale_down_above=60, min_instances=1, max_instances=4)


def inst(iid: str, used: int = 0, n: int = 0, total: int = 100, draining: bool = False) -> InstanceLoad:
    running = tuple(RequestLoad(f"{iid}-{i}", 16, blocks=used // max(1, n)) for i in range(n))
    return InstanceLoad(iid, total, total - used, 16, running=running, draining=draining)


def test_empty_cluster_scales_up_to_min() -> None:
    action = decide([], starting=0, config=CFG)
    assert action.kind == "scale-up"
    assert decide([], starting=1, config=CFG).kind == "none"


def test_scale_up_below_lower_bound() -> None:
    # 2 instances, 90 used of 100 each, 5 requests each: (200 - 180) / 10 = 2 < 10.
    loads = [inst("a", 90, 5), inst("b", 90, 5)]
    action = decide(loads, starting=0, config=CFG)
    assert action.kind == "scale-up" and action.aggregate_freeness == pytest.approx(2.0)
    assert decide(loads, starting=1, config=CFG).kind == "none"  # one start-up at a time
    full = [inst(x, 90, 5) for x in "abcd"]
    assert decide(full, starting=0, config=CFG).kind == "none"  # at max_instances


def test_starting_instances_count_with_their_capacity() -> None:
    # 2 instances, 98 used of 100 each, 10 requests each: (200 - 196) / 20 = 0.2.
    loads = [inst("a", 98, 10), inst("b", 98, 10)]
    # One starting: (300 - 196) / 20 = 5.2, still < 10 -> start another.
    assert decide(loads, starting=1, config=CFG).kind == "scale-up"
    # Two starting: (400 - 196) / 20 = 10.2 -> enough is on its way.
    assert decide(loads, starting=2, config=CFG).kind == "none"
    assert aggregate_freeness(loads, added_blocks=200) == pytest.approx(10.2)
    # None starting: both are started at once (one: 5.2, still short).
    action = decide(loads, starting=0, config=CFG)
    assert action.kind == "scale-up" and action.starts == 2


def queued(iid: str, prompt_tokens: tuple[int, ...]) -> InstanceLoad:
    """40 blocks used by 2 running requests, then a queue of the given prompts."""
    running = tuple(RequestLoad(f"{iid}-r{i}", 320, blocks=20) for i in range(2))
    waiting = tuple(RequestLoad(f"{iid}-w{i}", p) for i, p in enumerate(prompt_tokens))
    return InstanceLoad(iid, 100, 60, 16, running=running, waiting=waiting)


def test_the_whole_backlog_counts_not_just_each_head_of_line() -> None:
    # Queue 320 + 160 + 160 tokens = 20 + 10 + 10 blocks. Whole backlog: (100 - 40 - 40) / (2 + 3) = 4.
    # Counting only the head (20 blocks, batch 3) it would read (100 - 40 - 20) / 3 = 13.3: no scale-up.
    loads = [queued("a", (320, 160, 160))]
    assert aggregate_freeness(loads) == pytest.approx(4.0)
    assert decide(loads, starting=0, config=CFG).kind == "scale-up"


def test_between_bounds_nothing_happens() -> None:
    # (200 - 100) / 4 = 25: between 10 and 60; removing one: (100 - 100) / 4 = 0 -> no drain.
    loads = [inst("a", 50, 2), inst("b", 50, 2)]
    assert decide(loads, starting=0, config=CFG).kind == "none"


def test_scale_down_drains_the_freest_instance() -> None:
    # (300 - 30) / 3 = 90; without c's capacity (200 - 30) / 3 = 56.7 < 60 -> keep all.
    loads = [inst("a", 20, 2), inst("b", 10, 1), inst("c", 0, 0)]
    assert decide(loads, starting=0, config=CFG).kind == "none"
    # Lighter load: (300 - 10) / 1 ... without c: (200 - 10) / 1 = 190 > 60 -> drain c (freest, idle).
    loads = [inst("a", 10, 1), inst("b", 0, 0), inst("c", 0, 0)]
    action = decide(loads, starting=0, config=CFG)
    assert action.kind == "drain" and action.instance_id == "c"


def test_drain_candidate_prefers_freest_then_fewest_requests() -> None:
    # a: F = 80/1 = 80; b: F = 90/2 = 45; c: F = 50 / 1 = 50.
    assert drain_candidate([inst("a", 20, 1), inst("b", 10, 2), inst("c", 50, 1)]) == "a"
    # equal freeness 50: x has 2 requests (100-0)/2, y has 1 (100-50)/1 -> y has fewer requests
    assert drain_candidate([inst("x", 0, 2), inst("y", 50, 1)]) == "y"
    assert drain_candidate([inst("d", draining=True)]) is None


def test_never_below_min_instances_and_never_the_last_one() -> None:
    assert decide([inst("a")], starting=0, config=CFG).kind == "none"
    cfg2 = AutoscalingConfig(min_instances=2, max_instances=4)
    assert decide([inst("a"), inst("b")], starting=0, config=cfg2).kind == "none"
    assert decide([inst("a")], starting=0, config=cfg2).kind == "scale-up"


def test_drained_empty_means_no_request_and_no_migration_either_way() -> None:
    assert drained_empty(inst("b", draining=True))
    assert not drained_empty(inst("b"))  # serving, not drained
    assert not drained_empty(inst("b", 10, 1, draining=True))
    assert not drained_empty(replace(inst("b", draining=True), migrating_out=1))  # its last request leaving
    # An aborted final stage may hand a request back.
    assert not drained_empty(replace(inst("b", draining=True), migrating_in=1))


def test_an_empty_drained_instance_is_parked_for_the_grace_then_released() -> None:
    assert not release_due(None, now=500.0, park_s=60.0)  # not empty
    assert not release_due(100.0, now=159.9, park_s=60.0)
    assert release_due(100.0, now=160.0, park_s=60.0)
    assert release_due(100.0, now=100.0, park_s=0.0)  # no parking: released once seen empty


def test_a_scale_up_reuses_a_parked_instance_before_starting_one() -> None:
    # Serving a: (100 - 95) / 5 = 1 < 10. z is parked (empty), c still drains one request.
    loads = [inst("a", 95, 5), inst("c", 10, 1, draining=True), inst("z", draining=True)]
    assert reuse_order(loads) == ["z", "c"]  # the parked one is the freest, whatever its id
    action = decide(loads, starting=0, config=CFG)
    assert action.kind == "cancel-drain" and action.instance_id == "z"
    assert reuse_order([inst("a", 95, 5)]) == []
    assert decide([inst("a", 95, 5)], starting=0, config=CFG).kind == "scale-up"


def test_a_parked_instance_is_not_released_by_decide_and_blocks_a_second_drain() -> None:
    # Both serving instances idle, plenty of room without either: yet b is parked, so nothing more drains.
    loads = [inst("a", 0, 0), inst("x", 0, 0), inst("b", draining=True)]
    assert decide(loads, starting=0, config=CFG).kind == "none"
    assert decide(loads[:2], starting=0, config=CFG).kind == "drain"


def test_below_min_instances_a_parked_instance_is_put_back_first() -> None:
    cfg = AutoscalingConfig(scale_up_below=10, scale_down_above=60, min_instances=2, max_instances=4)
    action = decide([inst("a", 0, 0), inst("b", draining=True)], starting=0, config=cfg)
    assert action.kind == "cancel-drain" and action.instance_id == "b"
    assert decide([inst("a", 0, 0)], starting=0, config=cfg).kind == "scale-up"


def test_drain_in_progress_blocks_a_second_drain() -> None:
    loads = [inst("a", 0, 0), inst("b", 0, 0), inst("c", 10, 1, draining=True)]
    assert decide(loads, starting=0, config=CFG).kind == "none"


def test_drain_cancelled_when_load_rises() -> None:
    loads = [inst("a", 95, 5), inst("b", 10, 1, draining=True)]  # serving: (100 - 95) / 5 = 1 < 10
    action = decide(loads, starting=0, config=CFG)
    assert action.kind == "cancel-drain" and action.instance_id == "b"


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        AutoscalingConfig(min_instances=5, max_instances=2)
    with pytest.raises(ValueError):
        AutoscalingConfig(scale_up_below=60, scale_down_above=10)
    with pytest.raises(ValueError):
        AutoscalingConfig(park_s=-1.0)


def test_demand_is_what_the_aggregate_freeness_divides_and_no_capacity_changes_it() -> None:
    high = InstanceLoad("h", 100, 80, 16, running=(RequestLoad("h-0", 320, blocks=20, high_priority=True),))
    loads = [queued("a", (320, 160)), inst("b", 50, 2), inst("c", 10, 1, draining=True), high]
    demand = cluster_demand(loads)
    capacity = sum(load.total_blocks for load in loads if not load.draining)
    assert aggregate_freeness(loads) == pytest.approx((capacity - demand.blocks) / demand.requests)
    # An instance joining (or leaving, its requests migrated away) changes capacity, not demand.
    assert cluster_demand([*loads, inst("d")]) == demand
    assert cluster_demand([]) == ClusterDemand(0.0, 0)


def test_rising_demand_scales_up_one_start_up_ahead() -> None:
    # (200 - 100) / 4 = 25: between the bounds. Ten seconds ago the requests held 76 blocks: rising
    # 2.4 blocks/s, 30 s of start-up ahead they hold 172: (200 - 172) / 4 = 7 < 10 -> start one now.
    loads = [inst("a", 50, 2), inst("b", 50, 2)]
    assert decide(loads, starting=0, config=CFG).kind == "none"
    action = decide(loads, starting=0, config=CFG, previous=ClusterDemand(76, 4))
    assert action.kind == "scale-up" and action.starts == 1
    assert action.aggregate_freeness == pytest.approx(25.0) and action.demand == ClusterDemand(100, 4)
    assert projected_demand(ClusterDemand(100, 4), ClusterDemand(76, 4), CFG) == ClusterDemand(172, 4)
    # Rising more slowly (from 80: (200 - 160) / 4 = 10 ahead) or falling changes nothing.
    assert decide(loads, starting=0, config=CFG, previous=ClusterDemand(80, 4)).kind == "none"
    assert decide(loads, starting=0, config=CFG, previous=ClusterDemand(120, 6)).kind == "none"
    assert projected_demand(ClusterDemand(100, 4), ClusterDemand(120, 6), CFG) == ClusterDemand(100, 4)
    assert projected_demand(ClusterDemand(100, 4), None, CFG) == ClusterDemand(100, 4)
    # Only the blocks are projected, not the request count: from (90 blocks, 2 requests),
    # (200 - 130) / 4 = 17.5.
    assert projected_demand(ClusterDemand(100, 4), ClusterDemand(90, 2), CFG) == ClusterDemand(130, 4)
    assert decide(loads, starting=0, config=CFG, previous=ClusterDemand(90, 2)).kind == "none"


def test_a_burst_starts_every_instance_it_needs_at_once_even_while_others_start() -> None:
    # Demand rose by 90 blocks in the last interval: 30 s ahead 370 blocks for 4 requests; the
    # bound needs 4 * 10 + 370 = 410 blocks of capacity, 200 serve: start 3.
    cfg = replace(CFG, max_instances=8)
    loads = [inst("a", 50, 2), inst("b", 50, 2)]
    action = decide(loads, starting=0, config=cfg, previous=ClusterDemand(10, 1))
    assert action.kind == "scale-up" and action.starts == 3
    # One already starting: 2 more. The freeness with it, (300 - 100) / 4 = 50, is no reason to wait.
    action = decide(loads, starting=1, config=cfg, previous=ClusterDemand(10, 1))
    assert action.kind == "scale-up" and action.starts == 2
    assert decide(loads, starting=3, config=cfg, previous=ClusterDemand(10, 1)).kind == "none"
    # Never past max_instances.
    assert decide(loads, starting=0, config=CFG, previous=ClusterDemand(10, 1)).starts == 2


def test_nothing_is_projected_above_the_upper_bound() -> None:
    # (200 - 50) / 1 = 150 > 60: far from short; a rise of 50 blocks is not projected (it would
    # read (200 - 200) / 1 = 0), and without b's capacity (100 - 50) / 1 = 50 < 60: no drain either.
    loads = [inst("a", 50, 1), inst("b", 0, 0)]
    assert decide(loads, starting=0, config=CFG, previous=ClusterDemand(0, 0)).kind == "none"


def test_a_burst_puts_the_parked_instance_back_and_starts_the_rest_it_needs() -> None:
    # c is parked (drained, empty). Demand rose by 90 blocks in the last interval: 30 s ahead 370
    # blocks for 4 requests; the bound needs 4 * 10 + 370 = 410 blocks, 200 serve: 3 more, c and two
    # started in the same decision.
    cfg = replace(CFG, max_instances=8)
    loads = [inst("a", 50, 2), inst("b", 50, 2), inst("c", 0, 0, draining=True)]
    action = decide(loads, starting=0, config=cfg, previous=ClusterDemand(10, 1))
    assert action.kind == "cancel-drain" and action.instance_id == "c" and action.starts == 2
    # Not past max_instances (c's slot counts), and nothing more while the rest is starting.
    at_most_4 = replace(CFG, max_instances=4)
    assert decide(loads, starting=0, config=at_most_4, previous=ClusterDemand(10, 1)).starts == 1
    assert decide(loads, starting=2, config=cfg, previous=ClusterDemand(10, 1)).starts == 0


def test_rising_demand_cancels_a_drain_before_it_is_short() -> None:
    # c drains and still runs one request.
    loads = [inst("a", 50, 2), inst("b", 50, 2), inst("c", 10, 1, draining=True)]
    assert decide(loads, starting=0, config=CFG).kind == "none"
    action = decide(loads, starting=0, config=CFG, previous=ClusterDemand(76, 4))
    assert action.kind == "cancel-drain" and action.instance_id == "c"


def test_requests_held_by_the_routers_count_as_queued_ones() -> None:
    # (200 - 100) / 4 = 25: between the bounds. The routers hold 6 requests of 160 tokens (10 blocks
    # each at 16 tokens a block): (200 - 160) / 10 = 4 < 10 -> start; the bound needs 10 * 10 + 160 =
    # 260 blocks, 200 serve: one more instance.
    loads = [inst("a", 50, 2), inst("b", 50, 2)]
    assert decide(loads, starting=0, config=CFG).kind == "none"
    held = [160] * 6
    assert cluster_demand(loads, held_tokens=held) == ClusterDemand(160, 10)
    action = decide(loads, starting=0, config=CFG, held_tokens=held)
    assert action.kind == "scale-up" and action.starts == 1 and action.demand == ClusterDemand(160, 10)
    assert "6 requests held by the routers" in action.reason
    # A token past a block boundary takes a block of its own.
    assert cluster_demand(loads, held_tokens=[161]).blocks == 100 + 11
    # With no instance there is no block size: held requests count, their blocks cannot.
    assert cluster_demand([], held_tokens=held) == ClusterDemand(0.0, 6)
