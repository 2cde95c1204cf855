"""Migration pairing and request selection: hand-computed expectations."""

import pytest

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.policies.migration import (
    MigrationConfig,
    MigrationPair,
    admits,
    fits,
    migratable,
    pair_migrations,
    select_request,
    with_held_requests,
)


def r(rid: str, tokens: int = 32, blocks: int = 2, t: float = 0.0, hp: bool = False, migrating=False):
    return RequestLoad(rid, tokens, 0, blocks, high_priority=hp, arrival_time=t, migrating=migrating)


def inst(iid: str, free: int, running=(), waiting=(), total: int = 100, **kw) -> InstanceLoad:
    return InstanceLoad(iid, total, free, 16, running=tuple(running), waiting=tuple(waiting), **kw)


def loaded(iid: str, freeness_target: float, **kw) -> InstanceLoad:
    """An instance with one running request and the given freeness (free blocks = F)."""
    return inst(iid, free=int(freeness_target) + 0, running=[r(f"{iid}-r")], **kw)


def test_pairs_most_loaded_sources_with_freest_destinations() -> None:
    a = inst("a", free=10, running=[r("a1")], waiting=[r("aw", tokens=240)])  # F = (100-90-15)/2 = -2.5
    b = loaded("b", 2)  # F = 2
    c = loaded("c", 100 - 0)  # F = 100 (total 100, free 100 minus nothing)
    d = loaded("d", 50)  # F = 50
    e = inst("e", free=90, running=[r("e1")], draining=True)  # F = -inf
    pairs = pair_migrations([a, b, c, d, e], MigrationConfig(freeness_threshold=3))
    assert pairs == [MigrationPair("e", "c"), MigrationPair("a", "d")]


def test_instance_already_migrating_takes_no_new_pair() -> None:
    a = loaded("a", 1, migrating_out=1)
    b = loaded("b", 2)
    c = loaded("c", 90, migrating_in=1)
    d = loaded("d", 50)
    assert pair_migrations([a, b, c, d]) == [MigrationPair("b", "d")]
    assert pair_migrations([a, b, c, d], MigrationConfig(max_concurrent_per_instance=2)) == [
        MigrationPair("a", "c"),
        MigrationPair("b", "d"),
    ]


def test_preempting_instance_is_a_source_whatever_its_freeness() -> None:
    a = loaded("a", 40, preemptions=2)
    b = loaded("b", 90)
    assert pair_migrations([a, b]) == [MigrationPair("a", "b")]


def test_sources_need_a_running_request_and_destinations_must_be_free() -> None:
    only_queue = inst("q", free=100, waiting=[r("w", tokens=4000, blocks=0)])  # F < 0 but nothing to move
    free = loaded("f", 90)
    assert pair_migrations([only_queue, free]) == []
    low = loaded("low", 1)
    also_low = loaded("low2", 2)
    assert pair_migrations([low, also_low]) == []  # no destination at or above the threshold


def test_edge_cases_empty_and_single() -> None:
    assert pair_migrations([]) == []
    assert pair_migrations([loaded("one", 1)]) == []


def test_draining_instance_is_never_a_destination() -> None:
    src = loaded("src", 1)
    drain = inst("drain", free=100, draining=True)
    assert pair_migrations([src, drain]) == []


def test_select_request_policies() -> None:
    load = inst(
        "a",
        free=50,
        running=[
            r("old-long", tokens=500, t=1.0),
            r("new-mid", tokens=100, t=3.0),
            r("mid-short", tokens=20, t=2.0),
        ],
    )
    assert select_request(load, "last-come").request_id == "new-mid"
    assert select_request(load, "shortest").request_id == "mid-short"
    assert select_request(load, "longest").request_id == "old-long"
    with pytest.raises(ValueError, match="unknown request selection"):
        select_request(load, "random")


def test_high_priority_requests_stay_while_normal_ones_move() -> None:
    load = inst("a", free=50, running=[r("hp", t=9.0, hp=True), r("normal", t=1.0)])
    assert select_request(load, "last-come").request_id == "normal"
    only_hp = inst("b", free=50, running=[r("hp1", t=1.0, hp=True), r("hp2", t=2.0, hp=True)])
    assert select_request(only_hp, "last-come").request_id == "hp2"


def test_migrating_and_blockless_requests_are_not_candidates() -> None:
    load = inst("a", free=50, running=[r("moving", migrating=True), r("noblocks", blocks=0)])
    assert migratable(load) == []
    assert select_request(load) is None


def test_fits_checks_free_blocks_reservations_and_draining() -> None:
    req = r("x", blocks=10)
    assert fits(req, inst("d", free=11))
    assert not fits(req, inst("d", free=10))  # one block of growth is needed
    assert not fits(req, inst("d", free=20, reserved_blocks=10))
    assert not fits(req, inst("d", free=100, draining=True))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown request selection"):
        MigrationConfig(select="oldest")
    with pytest.raises(ValueError):
        MigrationConfig(max_concurrent_per_instance=0)


def test_admits_judges_the_destination_with_the_request_added() -> None:
    # Destination: 40 of 100 blocks used by two requests, a 10-block (160-token) head of line.
    dst = inst("d", free=60, running=[r("d1", blocks=20), r("d2", blocks=20)], waiting=[r("dw", tokens=160)])
    config = MigrationConfig(freeness_threshold=3, destination_freeness=3)
    # Before: (100 - 40 - 10) / 3 = 16.7. With a 30-block request: (100 - 70 - 10) / 4 = 5 >= 3.
    assert admits(r("m", tokens=480, blocks=30), dst, config)
    # With a 40-block request: (100 - 80 - 10) / 4 = 2.5 < 3, although 60 free blocks >= 41 fit it.
    big = r("m", tokens=640, blocks=40)
    assert fits(big, dst)
    assert not admits(big, dst, config)
    # The migrating flag of the moving request does not matter; draining never admits.
    assert admits(r("m", tokens=480, blocks=30, migrating=True), dst, config)
    assert not admits(r("m", blocks=2), inst("d", free=100, draining=True), config)


def test_a_destination_must_stay_at_the_floor_with_the_request_added() -> None:
    # Two 20-block requests on 100 blocks: F = 60 / 2 = 30 before any move.
    dst = inst("d", free=60, running=[r("d1", blocks=20), r("d2", blocks=20)])
    # A 20-block request leaves (100 - 60) / 3 = 13.3 >= 10: taken.
    assert admits(r("m", tokens=320, blocks=20), dst)
    # A 30-block one leaves (100 - 70) / 3 = 10: still at the floor.
    assert admits(r("m", tokens=480, blocks=30), dst)
    # A 31-block one leaves 29 / 3 = 9.7 < 10 although it fits (and 9.7 is above the source threshold 3):
    # the move would spend the room the destination's next arrivals need.
    assert fits(r("m", tokens=496, blocks=31), dst)
    assert not admits(r("m", tokens=496, blocks=31), dst)


def test_destinations_below_the_floor_are_not_paired() -> None:
    src = loaded("src", 1)
    assert pair_migrations([src, loaded("mid", 9)]) == []  # 9 >= threshold 3 but < floor 10
    assert pair_migrations([src, loaded("mid", 9), loaded("free", 10)]) == [MigrationPair("src", "free")]
    assert pair_migrations([src, loaded("mid", 9)], MigrationConfig(destination_freeness=3)) == [
        MigrationPair("src", "mid")
    ]
    with pytest.raises(ValueError):
        MigrationConfig(freeness_threshold=5, destination_freeness=4)


def test_a_chosen_threshold_above_the_destination_bound_raises_the_bound() -> None:
    assert MigrationConfig.with_threshold(3).destination_freeness == MigrationConfig().destination_freeness
    raised = MigrationConfig.with_threshold(1e9, "shortest", 2)
    assert raised.destination_freeness == raised.freeness_threshold == 1e9
    assert (raised.select, raised.max_concurrent_per_instance) == ("shortest", 2)


def test_held_requests_queue_one_per_instance_where_most_room_is_left() -> None:
    a = loaded("a", 60)
    b = loaded("b", 80, reserved_blocks=30)  # 50 blocks left for a new request
    c = inst("c", free=90, running=[r("c1")], waiting=[r("cw", tokens=320)])  # 20 blocks queued: 70 left
    held = with_held_requests([a, b, c], [480, 64, 16, 16])
    assert [load.instance_id for load in held] == ["a", "b", "c"]
    # In the routers' order: the first held request to the instance with the most room (c), the second
    # to the next (a), the third to b; the fourth finds no instance of its own.
    assert [[w.prompt_tokens for w in load.waiting] for load in held] == [[64], [16], [320, 480]]
    assert with_held_requests([a, b], []) == [a, b]


def test_held_requests_leave_the_room_to_a_drain() -> None:
    # The draining instance's requests must go; the held request would make the one destination busy.
    draining = inst("d", free=90, running=[r("d1", blocks=10)], draining=True)
    serving = inst("s", free=80, running=[r("s1", blocks=20)])
    loads = [draining, serving]
    assert with_held_requests(loads, [1600]) == loads
    assert pair_migrations(with_held_requests(loads, [1600])) == [MigrationPair("d", "s")]


def test_the_instance_a_held_request_waits_for_is_a_source_and_no_destination() -> None:
    # Without held requests the crowded instance moves a request to the one with room.
    crowded = inst("crowded", free=8, running=[r(f"c{k}", blocks=23) for k in range(4)])  # F = 2
    roomy = inst("roomy", free=70, running=[r(f"r{k}", blocks=10) for k in range(3)])  # F = 23.3
    assert pair_migrations([crowded, roomy]) == [MigrationPair("crowded", "roomy")]
    # A held 1,700-token request (107 blocks) fits nowhere and waits for roomy's room, which a request
    # moved in would take: roomy is no destination now, F = (100 - 30 - 107) / 4 < 3.
    assert pair_migrations(with_held_requests([crowded, roomy], [1700])) == []
    # With a roomier instance the held request waits there instead; its one request moving out frees
    # the room, and roomy, where nothing waits, takes it.
    roomier = inst("roomier", free=98, running=[r("x", blocks=2)])
    assert pair_migrations(with_held_requests([crowded, roomy, roomier], [1700])) == [
        MigrationPair("roomier", "roomy")]
