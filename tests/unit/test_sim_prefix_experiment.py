"""The prefix preset (`llumnix simulate --experiment prefix`): every shared-prefix point over
PREFIX_SEEDS seeds, the paper's traces over PREFIX_PAPER_SEEDS, and the per-request data that
explains a P99 (`prefix_dispatch_stats`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from llumnix.profile import DEFAULT_PROFILE, load_profile
from llumnix.sim.experiments import (
    FIG11_RATES,
    PREFIX_PAPER_SEEDS,
    PREFIX_RATES,
    PREFIX_SEEDS,
    PREFIX_SYSTEMS,
    ROBUSTNESS_SEEDS,
    _prefix_report,
    _prefix_specs,
    _robustness_specs,
)
from llumnix.sim.metrics import MISPLACED_BLOCKS, prefix_dispatch_stats
from llumnix.sim.request import SimRequest
from llumnix.sim.runner import RunSpec, simulate

PROFILE = load_profile(DEFAULT_PROFILE)


def test_every_shared_prefix_point_runs_on_every_seed_from_the_first() -> None:
    specs = _prefix_specs(100, 5, DEFAULT_PROFILE)
    shared = Counter((s.trace, s.rate, s.policy) for s in specs if s.label == "shared")
    points = {(t, r, p) for t, rates in PREFIX_RATES.items() for r in rates for p in PREFIX_SYSTEMS}
    assert set(shared) == points
    assert set(shared.values()) == {PREFIX_SEEDS}
    assert {s.seed for s in specs if s.label == "shared"} == set(range(5, 5 + PREFIX_SEEDS))
    paper = [s for s in specs if s.label == "paper"]
    assert {s.trace for s in paper} == set(FIG11_RATES)
    assert {s.seed for s in paper} == set(range(5, 5 + PREFIX_PAPER_SEEDS))
    # The robustness preset counts its seeds the same way.
    assert {s.seed for s in _robustness_specs(100, 5, DEFAULT_PROFILE)} == set(range(5, 5 + ROBUSTNESS_SEEDS))


def test_dispatch_records_what_the_chosen_and_the_best_instance_had_cached() -> None:
    result = simulate(RunSpec("llumnix-noprefix", "prefix-groups", 6.0, requests=150, instances=4))
    assert all(r.dispatched_cached_blocks <= r.best_cached_blocks for r in result.requests)
    assert any(r.best_cached_blocks > 0 for r in result.requests)
    # Freeness-only dispatch ignores the caches, so it misses some holders by a long prefix.
    assert any(r.best_cached_blocks - r.dispatched_cached_blocks >= MISPLACED_BLOCKS for r in result.requests)


def _served(prompt: int, best: int, chosen: int, prefill_s: float) -> SimRequest:
    request = SimRequest("r", 0.0, prompt, 1)
    request.best_cached_blocks = best
    request.dispatched_cached_blocks = chosen
    request.first_token_time = prefill_s
    return request


def test_stats_floor_misplacement_and_queueing() -> None:
    alone = PROFILE.iteration_time(2048, 0, 0, 2048 * 2048)
    # 99 requests whose 2,048-token prompt nobody had cached, served alone; one placed where its
    # 2,000 cached tokens were not, and queued for 2 s.
    requests = [_served(2048, 0, 0, alone) for _ in range(99)]
    requests.append(_served(2048, 125, 0, alone + 2.0))
    stats = prefix_dispatch_stats(requests, 16, PROFILE.iteration_time)
    assert stats["floor_p99"] == pytest.approx(alone)
    assert stats["misplaced"] == pytest.approx(0.01)
    assert stats["tail_misplaced"] == pytest.approx(1.0) and stats["tail_queued"] == pytest.approx(1.0)


def test_report_has_a_min_ratio_row_per_trace_and_rate(tmp_path: Path) -> None:
    specs = [
        RunSpec(p, "prefix-groups", 6.0, requests=60, instances=2, seed=s, label="shared")
        for s in (0, 1) for p in PREFIX_SYSTEMS
    ]
    results = [(spec, simulate(spec)) for spec in specs]
    text = "\n".join(_prefix_report(results, tmp_path))
    assert "seeds 0, 1" in text and "min p99 x" in text and "floor aware" in text
    assert (tmp_path / "prefix.png").exists()
