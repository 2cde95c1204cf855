"""bench/router_peer_p99.py's parts that need no service: the order the paths run in, the tail
analysis (a slow request that waited while another instance had room for it), pooling repeats, the
ratios against the peer's best policy and the table. The whole benchmark is run by hand (docs/router.md)."""

from __future__ import annotations

from types import ModuleType

import pytest
from script_module import load_bench

from llumnix.bench import RequestResult
from llumnix.service_spec import parse_service


@pytest.fixture(scope="module")
def p99() -> ModuleType:
    return load_bench("router_peer_p99")


def request(request_id: int, arrival: float, ttft: float | None, error: str | None = None) -> RequestResult:
    first = None if ttft is None else arrival + ttft
    return RequestResult(request_id, arrival, first, None if first is None else first + 1.0, 10, error)


def fleet(p99: ModuleType, time: float, *instances: tuple[int, int, int], queue: int = 0) -> object:
    return p99.FleetSample(time, queue, tuple(p99.InstanceSample(*i) for i in instances))


def test_every_path_runs_first_at_some_load_and_repeats_reverse_the_order(p99: ModuleType) -> None:
    paths = p99.path_names()
    assert paths[:2] == ["llumnix", "llumnix+migration"] and len(paths) == 5
    assert all(p.startswith("vllm-router:") for p in paths[2:])
    assert p99.path_names(migration=False) == [paths[0], *paths[2:]]
    firsts = {p99.run_order(paths, load, 0)[0] for load in range(len(paths))}
    assert firsts == set(paths)
    for load in range(3):
        forward = p99.run_order(paths, load, 0)
        assert sorted(forward) == sorted(paths)
        assert p99.run_order(paths, load, 1) == forward[::-1] == p99.run_order(paths, load, 3)


def test_a_prompt_needs_its_blocks_plus_the_first_output_token(p99: ModuleType) -> None:
    assert p99.blocks_for(15) == 1
    assert p99.blocks_for(16) == 2
    assert p99.blocks_for(599) == 38


def test_room_elsewhere_needs_an_instance_without_a_queue_and_with_the_blocks(p99: ModuleType) -> None:
    # (free blocks, running, waiting)
    assert p99.has_room_elsewhere(fleet(p99, 0, (0, 3, 2), (40, 1, 0)), 38)
    assert not p99.has_room_elsewhere(fleet(p99, 0, (0, 3, 2), (20, 1, 0)), 38)  # too few blocks
    assert not p99.has_room_elsewhere(fleet(p99, 0, (0, 3, 2), (64, 0, 1)), 38)  # a queue there


def test_a_slow_request_is_misplaced_when_room_elsewhere_lasted_most_of_its_wait(p99: ModuleType) -> None:
    prompts = {0: 599, 1: 599, 2: 10, 3: 10}
    results = [request(0, 0.0, 2.0),  # waited 0-2 s; room elsewhere in 3 of its 5 samples
               request(1, 10.0, 2.0),  # waited 10-12 s with every instance full, the router holding
               request(2, 0.0, 0.1),  # fast
               request(3, 0.0, None, error="http-503")]
    samples = [fleet(p99, t, (0, 3, 2), (50, 1, 0)) for t in (0.0, 0.5, 1.0)]
    samples += [fleet(p99, t, (0, 3, 2), (0, 3, 1)) for t in (1.5, 2.0)]
    samples += [fleet(p99, t, (0, 3, 2), (0, 3, 1), queue=2) for t in (10.0, 11.0, 12.0)]
    tail = p99.tail_report(results, prompts, samples, slow_ttft_s=1.0)
    assert (tail.slow, tail.slow_with_room) == (2, 1)
    assert tail.router_held_share == pytest.approx(3 / 8)


def test_repeats_are_pooled_and_the_peer_with_the_lowest_p99_is_the_reference(p99: ModuleType) -> None:
    prompts = {i: 100 for i in range(100)}

    def run(path: str, ttfts: list[float], repeat: int = 0) -> object:
        return p99.Run(path, 2.0, repeat, [request(i, float(i), t) for i, t in enumerate(ttfts)], 100.0)

    fast, slow_tail = [0.1] * 100, [0.1] * 98 + [3.0, 3.0]
    mine = p99.pooled_row([run("llumnix", fast), run("llumnix", slow_tail, 1)], prompts, 1.0)
    assert mine.summary["finished"] == 200 and mine.p99_per_repeat == (pytest.approx(0.1), pytest.approx(3.0))
    assert mine.tail.slow == 2
    rows = [mine,
            p99.pooled_row([run("vllm-router:round_robin", [0.05] * 90 + [4.0] * 10)], prompts, 1.0),
            p99.pooled_row([run("vllm-router:power_of_two", [0.2] * 98 + [1.5, 1.5])], prompts, 1.0)]
    comparison = p99.compare(rows, "llumnix")
    assert comparison.peer_best_p99_path == "vllm-router:power_of_two"
    assert comparison.p99_ratio == pytest.approx(1.5 / float(mine.summary["prefill_p99"]))
    assert comparison.peer_best_mean_path == "vllm-router:power_of_two"  # 0.226 s against 0.445 s
    assert comparison.mean_ratio == pytest.approx(0.226 / float(mine.summary["prefill_mean"]))
    assert p99.compare(rows, "llumnix+migration") is None
    table = p99.format_rows(rows, 1.0)
    assert table.count("\n") == 4 and "| llumnix | 200 / 0 |" in table
    verdict = p99.format_comparison(comparison)
    assert ("does not meet" in verdict) == (not comparison.met)


def test_the_target_is_twice_the_peers_p99_at_no_worse_mean(p99: ModuleType) -> None:
    def comparison(p99_ratio: float, mean_ratio: float) -> object:
        return p99.Comparison(2.0, "llumnix", "vllm-router:power_of_two", p99_ratio,
                              "vllm-router:cache_aware", mean_ratio)

    assert comparison(2.0, 1.0).met
    assert not comparison(1.9, 1.5).met
    assert not comparison(3.0, 0.9).met


def test_migration_is_switched_on_and_off_without_touching_the_rest(p99: ModuleType) -> None:
    settings = parse_service(p99.manifest(8, 0.5))
    assert not settings.spec.migration.enabled
    on = p99.with_migration(settings, True)
    assert on.spec.migration.enabled and on.spec.engine == settings.spec.engine
    assert p99.with_migration(on, False) == settings


def test_the_help_explains_the_paths(p99: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        p99.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "vllm-router:POLICY" in out and "--client SPEC" not in out and "--json JSON" in out
    with pytest.raises(SystemExit):
        p99.parse_args(["--paths", "llumnix,nginx"])
