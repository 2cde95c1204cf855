"""Load model: hand-computed virtual usage and freeness."""

import math

import pytest

from llumnix.load import (
    InstanceLoad,
    LoadModelConfig,
    RequestLoad,
    aggregate_freeness,
    batch_size,
    blocks_for_tokens,
    dispatch_freeness,
    freeness,
    head_of_line_demand,
    high_priority_headroom,
    memory_load,
    virtual_usage,
    with_pending,
    without_requests,
)


def req(rid: str, prompt: int, output: int = 0, blocks: int = 0, **kw) -> RequestLoad:
    return RequestLoad(rid, prompt_tokens=prompt, output_tokens=output, blocks=blocks, **kw)


def inst(iid: str = "a", total: int = 100, free: int = 100, running=(), waiting=(), **kw) -> InstanceLoad:
    return InstanceLoad(
        iid,
        total_blocks=total,
        free_blocks=free,
        block_size=16,
        running=tuple(running),
        waiting=tuple(waiting),
        **kw,
    )


def test_blocks_for_tokens_rounds_up() -> None:
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2


def test_running_only_uses_physical_blocks() -> None:
    load = inst(free=60, running=[req("r1", 300, blocks=20), req("r2", 310, blocks=20)])
    assert virtual_usage(load) == 40
    assert batch_size(load) == 2
    assert freeness(load) == pytest.approx(30.0)  # (100 - 40) / 2


def test_head_of_line_demand_counts_only_the_first_queued_request() -> None:
    load = inst(
        free=60,
        running=[req("r1", 300, blocks=20), req("r2", 310, blocks=20)],
        waiting=[req("w1", 50), req("w2", 1000)],
    )
    assert head_of_line_demand(load) == 4  # ceil(50 / 16)
    assert virtual_usage(load) == 44
    assert batch_size(load) == 3  # two running + one because something waits
    assert freeness(load) == pytest.approx(56 / 3)


def test_preempted_request_demands_prompt_plus_generated_tokens() -> None:
    load = inst(waiting=[req("w", 20, output=30)])
    assert head_of_line_demand(load) == 4  # ceil(50 / 16)


def test_idle_instance_freeness_is_its_free_blocks() -> None:
    assert freeness(inst(free=100)) == 100.0


def test_huge_queued_request_makes_freeness_negative() -> None:
    load = inst(waiting=[req("huge", 10_000)])
    assert virtual_usage(load) == 625
    assert freeness(load) == pytest.approx(-525.0)


def test_draining_instance_has_infinite_usage() -> None:
    load = inst(free=90, running=[req("r", 100, blocks=10)], draining=True)
    assert math.isinf(virtual_usage(load))
    assert freeness(load) == -math.inf
    assert memory_load(load) == math.inf


def test_high_priority_headroom_keeps_instance_near_target_load() -> None:
    # 200 blocks of 16 tokens; target 1600 tokens = 100 blocks, so 100 blocks are held as headroom.
    load = inst(total=200, free=190, running=[req("hp", 150, blocks=10, high_priority=True)])
    assert high_priority_headroom(load) == 100
    assert virtual_usage(load) == 110
    assert freeness(load) == pytest.approx(90.0)
    # The headroom is per instance, not per request.
    two = inst(
        total=200,
        free=180,
        running=[
            req("hp1", 150, blocks=10, high_priority=True),
            req("hp2", 150, blocks=10, high_priority=True),
        ],
    )
    assert virtual_usage(two) == 120
    # A configurable target.
    assert high_priority_headroom(load, LoadModelConfig(high_priority_target_tokens=3200)) == 0


def test_queued_high_priority_request_also_reserves_headroom() -> None:
    load = inst(total=200, free=200, waiting=[req("hp", 16, high_priority=True)])
    assert virtual_usage(load) == 1 + 100


def test_reserved_blocks_count_as_used() -> None:
    load = inst(free=100, reserved_blocks=30)
    assert virtual_usage(load) == 30
    assert freeness(load) == 70.0


def test_memory_load_counts_every_queued_request() -> None:
    load = inst(free=60, running=[req("r", 600, blocks=40)], waiting=[req("w1", 50), req("w2", 20)])
    assert memory_load(load) == pytest.approx((40 + 4 + 2) / 100)


def test_aggregate_freeness_treats_cluster_as_one_instance() -> None:
    busy = inst("a", free=60, running=[req("r1", 300, blocks=20), req("r2", 300, blocks=20)])
    idle = inst("b")
    assert aggregate_freeness([busy, idle]) == pytest.approx((200 - 40) / 2)
    # Without b's capacity (b drained away), its requests (none) stay.
    assert aggregate_freeness([busy, idle], exclude_capacity_of="b") == pytest.approx((100 - 40) / 2)
    # Without a's capacity its requests still count.
    assert aggregate_freeness([busy, idle], exclude_capacity_of="a") == pytest.approx((100 - 40) / 2)
    # Draining instances are left out entirely; an empty cluster has zero freeness.
    assert aggregate_freeness([busy, inst("c", draining=True)]) == pytest.approx(30.0)
    assert aggregate_freeness([]) == 0.0


def test_with_pending_appends_to_queue() -> None:
    load = inst(waiting=[req("w1", 16)])
    pending = with_pending(load, [req("p1", 160)])
    assert [r.request_id for r in pending.waiting] == ["w1", "p1"]
    assert with_pending(load, []) is load
    # Pending requests behind the head of line change batch size but not head-of-line demand.
    assert head_of_line_demand(pending) == 1
    assert freeness(with_pending(inst(), [req("p", 160)])) == pytest.approx((100 - 10) / 1)


def test_without_requests_frees_the_blocks_of_ended_requests() -> None:
    load = inst(free=40, running=[req("r1", 300, blocks=20), req("r2", 310, blocks=40)],
                waiting=[req("w1", 16), req("w2", 32)])
    current = without_requests(load, {"r2", "w1", "unknown"})
    assert [r.request_id for r in current.running] == ["r1"]
    assert [r.request_id for r in current.waiting] == ["w2"]
    assert current.free_blocks == 80 and current.used_blocks == 20
    assert without_requests(load, set()) is load


def test_dispatch_freeness_counts_the_whole_queue_and_the_new_request() -> None:
    load = inst(
        free=60,
        running=[req("r1", 300, blocks=20), req("r2", 310, blocks=20)],
        waiting=[req("w1", 50), req("w2", 100)],
    )
    # used 40 + queued 4 + 7 = 51 over 2 running + 2 queued.
    assert dispatch_freeness(load) == pytest.approx((100 - 51) / 4)
    # A new 160-token request adds 10 blocks and one to the batch.
    assert dispatch_freeness(load, req("new", 160)) == pytest.approx((100 - 61) / 5)


def test_dispatch_freeness_prefers_room_over_a_small_batch() -> None:
    # Two huge requests nearly fill `full`; `roomy` has many small ones but the memory.
    full = inst("full", free=15, running=[req("h1", 700, blocks=43), req("h2", 700, blocks=42)])
    roomy = inst("roomy", free=60, running=[req(f"s{i}", 60, blocks=4) for i in range(10)])
    big = req("new", 320)  # 20 blocks
    assert freeness(full) > freeness(roomy)  # by plain freeness `full` looks freer
    assert dispatch_freeness(full, big) < 0 < dispatch_freeness(roomy, big)


def test_dispatch_freeness_of_high_priority_and_draining() -> None:
    load = inst(total=200, free=200)
    assert dispatch_freeness(load, req("hp", 16, high_priority=True)) == pytest.approx((200 - 1 - 100) / 1)
    assert dispatch_freeness(inst(draining=True), req("x", 16)) == -math.inf


def test_dispatch_freeness_reports_an_over_subscribed_instance_deficit_undivided() -> None:
    # `few`: 90 blocks used by one request; a 30-block request leaves a deficit of 20 blocks.
    few = inst("few", free=10, running=[req("f1", 1440, blocks=90)])
    # `crowded`: 95 blocks used by nine requests; the same request leaves a deficit of 25 blocks.
    crowded = inst("crowded", free=5, running=[req(f"c{i}", 160, blocks=10 + (i < 5)) for i in range(9)])
    new = req("new", 480)  # 30 blocks
    assert dispatch_freeness(few, new) == pytest.approx(-20.0)
    assert dispatch_freeness(crowded, new) == pytest.approx(-25.0)
    # Divided by the batch (-20/2 = -10 vs -25/10 = -2.5) the crowded instance would look freer.
    assert dispatch_freeness(few, new) > dispatch_freeness(crowded, new)
    # Exactly full is not a deficit: 0 blocks of headroom.
    assert dispatch_freeness(inst(free=30, running=[req("r", 1120, blocks=70)]), new) == 0.0
