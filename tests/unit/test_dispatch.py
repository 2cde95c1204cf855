"""Dispatch policies: hand-computed choices and edge cases."""

import random
from collections import Counter

import pytest

from llumnix.load import InstanceLoad, RequestLoad, engine_queues
from llumnix.policies.dispatch import (
    MAX_HOLD_S,
    DispatchDecision,
    dispatch_held,
    make_dispatch_policy,
    placement,
)


def inst(iid: str, total: int = 100, free: int = 100, n_running: int = 0, waiting_tokens=(), draining=False):
    running = tuple(RequestLoad(f"{iid}-r{i}", 16, blocks=1) for i in range(n_running))
    waiting = tuple(RequestLoad(f"{iid}-w{i}", t) for i, t in enumerate(waiting_tokens))
    return InstanceLoad(iid, total, free, 16, running=running, waiting=waiting, draining=draining)


# a: 50 used, 1 running -> F = 50, memory 0.5; b: 40 used, 10 running -> F = 6, memory 0.4
A = inst("a", free=50, n_running=1)
B = inst("b", free=60, n_running=10)


def test_llumnix_picks_highest_freeness() -> None:
    decision = make_dispatch_policy("llumnix").choose([A, B])
    assert decision is not None and decision.instance_id == "a" and not decision.all_busy


def test_llumnix_sends_a_request_where_nothing_queues_ahead_of_it() -> None:
    """`long` just got a 6,000-token prompt (375 of its 1,000 blocks), queued until its next step;
    `short` has less memory and no queue. By freeness alone the next request would go to `long`,
    (996 - 375 - 1) / 6 = 103 against (300 - 1) / 3 = 99.7, and wait there for that prefill."""
    long = inst("long", total=1000, free=996, n_running=4, waiting_tokens=[6000])
    short = inst("short", total=1000, free=300, n_running=2)
    small = RequestLoad("next", 16)
    policy = make_dispatch_policy("llumnix")
    assert policy.choose([long, short], small).instance_id == "short"
    # An instance without a queue but with less than QUEUED_HEADROOM, (4 - 1) / 3 = 1, does not win.
    cramped = inst("cramped", total=1000, free=4, n_running=2)
    assert policy.choose([long, cramped], small).instance_id == "long"
    # Among queued instances the freer still wins.
    shorter_queue = inst("shorter", total=1000, free=996, n_running=4, waiting_tokens=[160])
    assert policy.choose([long, shorter_queue], small).instance_id == "shorter"


def test_infaas_picks_lowest_memory_load_counting_queue() -> None:
    assert make_dispatch_policy("infaas++").choose([A, B]).instance_id == "b"
    # A queue of 20 blocks on b makes its memory load 0.6 > 0.5.
    b_queued = inst("b", free=60, n_running=10, waiting_tokens=[160, 160])
    assert make_dispatch_policy("infaas++").choose([A, b_queued]).instance_id == "a"


def test_least_requests_counts_running_and_waiting() -> None:
    c = inst("c", n_running=2)
    d = inst("d", n_running=1, waiting_tokens=[16, 16])
    assert make_dispatch_policy("least-requests").choose([c, d]).instance_id == "c"


def test_llumnix_excludes_busy_instances_and_flags_all_busy() -> None:
    # x: huge head-of-line request => F = 100 - 625 < 0 (busy); y: F = 2.
    x = inst("x", waiting_tokens=[10_000])
    y = inst("y", free=4, n_running=48)
    policy = make_dispatch_policy("llumnix", busy_freeness=3.0)
    decision = policy.choose([x, y])
    assert decision.instance_id == "y" and decision.all_busy  # both below 3: best of the busy
    z = inst("z", free=40, n_running=10)  # F = 4
    decision = policy.choose([x, y, z])
    assert decision.instance_id == "z" and not decision.all_busy


def test_ties_are_broken_at_random_among_the_best_only() -> None:
    policy = make_dispatch_policy("llumnix", rng=random.Random(1))
    loads = [inst("a"), inst("b"), inst("c", free=10, n_running=1)]
    picks = Counter(policy.choose(loads).instance_id for _ in range(200))
    assert set(picks) == {"a", "b"}
    assert min(picks.values()) > 50


def test_top_k_spreads_over_the_k_best() -> None:
    policy = make_dispatch_policy("llumnix", top_k=2, rng=random.Random(3))
    loads = [inst("a", free=90), inst("b", free=80), inst("c", free=10)]
    picks = Counter(policy.choose(loads).instance_id for _ in range(200))
    assert set(picks) == {"a", "b"}


def test_same_seed_same_choices() -> None:
    loads = [inst("a"), inst("b"), inst("c")]
    p1 = make_dispatch_policy("llumnix", rng=random.Random(7))
    p2 = make_dispatch_policy("llumnix", rng=random.Random(7))
    picks1 = [p1.choose(loads).instance_id for _ in range(20)]
    assert picks1 == [p2.choose(loads).instance_id for _ in range(20)]


def test_round_robin_cycles_and_skips_draining() -> None:
    policy = make_dispatch_policy("round-robin")
    loads = [inst("a"), inst("b"), inst("c")]
    assert [policy.choose(loads).instance_id for _ in range(4)] == ["a", "b", "c", "a"]
    loads = [inst("a"), inst("b", draining=True), inst("c")]
    assert [policy.choose(loads).instance_id for _ in range(3)] == ["c", "a", "c"]
    # An instance that appears is picked up in order; one that vanished is simply skipped.
    assert policy.choose([inst("a"), inst("d")]).instance_id == "d"


@pytest.mark.parametrize("name", ["llumnix", "infaas++", "round-robin", "least-requests"])
def test_edge_cases(name: str) -> None:
    policy = make_dispatch_policy(name)
    assert policy.choose([]) is None
    assert policy.choose([inst("a", draining=True)]) is None
    one = policy.choose([inst("only", free=0, n_running=100)])
    assert one is not None and one.instance_id == "only"
    assert policy.choose([inst("a", draining=True), inst("b")]).instance_id == "b"


def test_draining_instance_is_never_chosen_even_if_freest() -> None:
    for name in ("llumnix", "infaas++", "least-requests"):
        loads = [inst("drain", draining=True), inst("busy", free=1, n_running=99)]
        assert make_dispatch_policy(name).choose(loads).instance_id == "busy"


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown dispatch policy 'fastest'"):
        make_dispatch_policy("fastest")
    with pytest.raises(ValueError, match="top_k"):
        make_dispatch_policy("llumnix", top_k=0)


def test_placement_holds_only_while_every_engine_would_queue_the_request_and_none_is_idle() -> None:
    free, busy = DispatchDecision("a"), DispatchDecision("a", all_busy=True)
    queues, never_idle, idle_b = (lambda _iid: True), (lambda _iid: False), ["b"]
    assert placement(None, queues, never_idle, idle_b) is None  # no instance at all
    assert placement(free, queues, never_idle, []) == "a"
    assert placement(busy, queues, never_idle, []) is None
    assert placement(busy, queues, never_idle, idle_b) == "b"  # nothing to finish: nothing would wake it
    assert placement(busy, queues, lambda iid: iid == "a", idle_b) == "a"
    # busy only by the high-priority headroom: the engine would admit it now
    assert placement(busy, lambda _iid: False, never_idle, []) == "a"
    # passed by smaller requests for long enough, it waits in the chosen engine's queue
    assert placement(busy, queues, never_idle, [], passed_s=MAX_HOLD_S) == "a"
    assert placement(busy, queues, never_idle, [], passed_s=MAX_HOLD_S - 0.1) is None


def test_an_engine_queues_what_does_not_fit_beside_its_requests_and_queue_headroom_aside() -> None:
    vip = RequestLoad("vip", 160, blocks=10, high_priority=True)
    load = InstanceLoad("a", 100, 60, 16, running=(vip, RequestLoad("r", 480, blocks=30)),
                        waiting=(RequestLoad("w", 320),))  # 40 used, 20 queued: 40 left
    assert not engine_queues(load, RequestLoad("fits", 640))  # 40 blocks
    assert engine_queues(load, RequestLoad("does-not", 656))  # 41 blocks
    assert engine_queues(InstanceLoad("d", 100, 100, 16, draining=True), RequestLoad("x", 16))


def test_held_requests_let_smaller_ones_of_their_priority_pass_never_larger_ones() -> None:
    # (name, tokens, high priority), in dispatch order; room for 200 tokens
    held = [("big", 800, False), ("small", 100, False), ("same", 800, False), ("medium", 150, False)]
    room = [200]
    offered: list[str] = []

    def place(request: tuple[str, int, bool]) -> bool:
        offered.append(request[0])
        if request[1] > room[0]:
            return False
        room[0] -= request[1]
        return True

    passed: list[str] = []
    still = dispatch_held(held, lambda r: r[1], lambda r: r[2], place, lambda r: passed.append(r[0]))
    assert offered == ["big", "small", "medium"]  # "same" could not fit where "big" did not
    assert [r[0] for r in still] == ["big", "same", "medium"]  # 100 + 150 > 200: medium waits too
    assert passed == ["big"]  # "small" went ahead of it
    # a high-priority request that cannot be placed blocks every normal one behind it
    offered.clear()
    room[0] = 200
    still = dispatch_held([("vip", 800, True), ("vip-small", 100, True), ("small", 50, False)],
                          lambda r: r[1], lambda r: r[2], place, lambda r: None)
    assert offered == ["vip", "vip-small"] and [r[0] for r in still] == ["vip", "small"]
