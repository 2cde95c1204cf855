"""Whole-cluster simulations: invariants, determinism, preemption, migration, autoscaling."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest

from llumnix.policies.autoscaling import AutoscalingConfig
from llumnix.profile import load_profile
from llumnix.sim.cluster import Cluster
from llumnix.sim.instance import SimInstance
from llumnix.sim.metrics import LATENCY_KEYS, latency_summary
from llumnix.sim.systems import SimConfig, system
from llumnix.traces import TraceRequest, generate_trace

PROFILE = load_profile()


@pytest.fixture
def audited(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Check every instance's block accounting after each iteration; count finishes per request."""
    finishes: Counter[str] = Counter()
    complete = SimInstance.complete

    def audited_complete(self: SimInstance, now: float) -> list:
        finished = complete(self, now)
        self.check_blocks()
        finishes.update(r.request_id for r in finished)
        return finished

    monkeypatch.setattr(SimInstance, "complete", audited_complete)
    return finishes


def heavy_trace(n: int = 400, seed: int = 0) -> list[TraceRequest]:
    return generate_trace("L-L", n, rate=3.0, seed=seed)


@pytest.mark.parametrize("policy", ["llumnix", "infaas++", "round-robin", "least-requests"])
def test_every_request_finishes_once_and_no_block_leaks(audited: Counter[str], policy: str) -> None:
    trace = heavy_trace()
    cluster = Cluster(trace, system(policy), PROFILE, instances=4)
    result = cluster.run()
    assert sorted(audited) == sorted(str(t.request_id) for t in trace)
    assert set(audited.values()) == {1}
    for r in result.requests:
        assert r.arrival_time <= r.first_token_time <= r.finish_time and r.generated == r.output_tokens
    for inst in cluster.ready:
        assert inst.free_blocks == inst.total_blocks and inst.reserved_blocks == 0 and inst.num_requests == 0
    assert result.summary()["finished"] == len(trace)


def test_the_summary_reports_the_slowest_prefill_and_the_tail_mean_beside_the_p99() -> None:
    result = Cluster(heavy_trace(), system("round-robin"), PROFILE, instances=4).run()
    summary = result.summary()
    prefills = sorted(r.first_token_time - r.arrival_time for r in result.requests)
    assert summary["prefill_max"] == pytest.approx(prefills[-1])
    slowest = prefills[-max(1, round(len(prefills) / 100)):]
    assert summary["prefill_tail_mean"] == pytest.approx(sum(slowest) / len(slowest))
    assert summary["prefill_p99"] < summary["prefill_max"]


def test_a_selection_without_finished_requests_has_the_same_keys_as_one_with_them() -> None:
    result = Cluster(heavy_trace(), system("round-robin"), PROFILE, instances=4).run()
    empty = latency_summary([])
    assert set(empty) == set(latency_summary(result.requests)) == {*LATENCY_KEYS, "finished"}
    assert set(empty.values()) == {0}


def test_memory_pressure_preempts_and_the_loss_is_accounted() -> None:
    result = Cluster(heavy_trace(), system("round-robin"), PROFILE, instances=4).run()
    summary = result.summary()
    assert summary["preemptions"] > 0 and summary["preemption_loss"] > 0
    preempted = [r for r in result.requests if r.preemptions]
    assert preempted and all(r.preemption_loss > 0 for r in preempted)


def test_same_seed_same_results_and_another_seed_differs() -> None:
    def run(seed: int) -> dict:
        return Cluster(heavy_trace(150, seed=seed), system("llumnix"), PROFILE, 4, seed=seed).run().summary()

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_llumnix_migrates_with_short_downtime_and_baselines_never_do() -> None:
    trace = heavy_trace()
    migrating = Cluster(trace, system("llumnix"), PROFILE, instances=4).run()
    assert len(migrating.migration_downtimes) > 0
    # The final stage copies at most a block or so: about the transfer's fixed cost, far below a decode step.
    assert max(migrating.migration_downtimes) < PROFILE.kv_transfer_time(PROFILE.block_size * 8)
    assert min(migrating.migration_downtimes) >= PROFILE.kv_transfer_time(0)
    assert Cluster(trace, system("infaas++"), PROFILE, instances=4).run().migration_downtimes == []


def burst_then_quiet() -> list[TraceRequest]:
    burst = generate_trace("M-M", 600, rate=12.0, seed=3)
    end = burst[-1].arrival_time
    quiet = generate_trace("S-S", 40, rate=0.2, seed=4)
    return burst + [
        replace(t, request_id=t.request_id + 600, arrival_time=end + t.arrival_time) for t in quiet
    ]


@pytest.mark.parametrize("policy", ["llumnix", "infaas++"])
def test_autoscaling_scales_up_then_drains_and_releases(audited: Counter[str], policy: str) -> None:
    # Released once empty (no parking: its own tests below); INFaaS++'s drain ends late in the quiet tail.
    scaling = AutoscalingConfig(min_instances=1, max_instances=8, interval_s=2.0, startup_delay_s=5.0,
                                park_s=0.0)
    trace = burst_then_quiet()
    cluster = Cluster(trace, system(policy), PROFILE, instances=2, config=SimConfig(autoscaling=scaling))
    result = cluster.run()
    counts = result.instance_counts
    peak = counts.index(max(counts))
    assert max(counts) > 2 and min(counts[peak:]) < max(counts)
    assert cluster.released and all(
        i.num_requests == 0 and i.free_blocks == i.total_blocks for i in cluster.released
    )
    assert len(audited) == len(trace) and set(audited.values()) == {1}
    assert 1 <= result.avg_instances <= 8


def first_release_time(stabilization_s: float, park_s: float = 0.0) -> float:
    """Four instances, a trickle of short requests: the autoscaler (every 10 s) wants to shrink at once."""
    scaling = AutoscalingConfig(min_instances=1, max_instances=4, interval_s=10.0, park_s=park_s)
    config = SimConfig(autoscaling=scaling, scale_down_stabilization_s=stabilization_s)
    trace = generate_trace("S-S", 60, rate=0.3, seed=5)
    result = Cluster(trace, system("llumnix"), PROFILE, instances=4, config=config).run()
    counts, times = result.instance_counts, result.instance_times
    return next(t for t, before, after in zip(times[1:], counts, counts[1:], strict=False) if after < before)


def test_scale_down_waits_for_the_stabilization_window() -> None:
    # Drain wanted from the first tick (10 s); released at the tick after the drain (empty by then).
    assert first_release_time(0.0) == pytest.approx(20.0)
    # Wanted since 10 s, drained at 40 s (30 s later), released at 50 s.
    assert first_release_time(30.0) == pytest.approx(50.0)


def test_a_drained_instance_is_parked_before_it_is_released() -> None:
    # Drained at 10 s, found empty at 20 s, parked for 60 s: released at 80 s.
    assert first_release_time(0.0, park_s=60.0) == pytest.approx(80.0)


def quiet_then_burst() -> list[TraceRequest]:
    """A trickle for the first minute (scale-down wanted), then a burst that needs every instance."""
    quiet = generate_trace("S-S", 15, rate=0.3, seed=4)
    burst = generate_trace("M-M", 400, rate=12.0, seed=3)
    return quiet + [replace(t, request_id=t.request_id + 100, arrival_time=60.0 + t.arrival_time)
                    for t in burst]


def autoscaled_ids(park_s: float) -> tuple[list[str], Cluster]:
    scaling = AutoscalingConfig(min_instances=1, max_instances=4, interval_s=10.0, park_s=park_s)
    config = SimConfig(autoscaling=scaling, scale_down_stabilization_s=0.0)
    cluster = Cluster(quiet_then_burst(), system("llumnix"), PROFILE, instances=4, config=config)
    cluster.run()
    return sorted(i.instance_id for i in cluster.released + cluster.ready + cluster.starting), cluster


def test_a_scale_up_puts_a_parked_instance_back_instead_of_starting_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Released at once, the drained instance is gone when the burst comes: a new one is started.
    ids, _ = autoscaled_ids(park_s=0.0)
    assert "i004" in ids
    flags: list[tuple[str, bool]] = []
    set_draining = SimInstance.set_draining

    def recorded(self: SimInstance, draining: bool) -> None:
        flags.append((self.instance_id, draining))
        set_draining(self, draining)

    monkeypatch.setattr(SimInstance, "set_draining", recorded)
    # Parked for 5 minutes, the drained instance (i003, the freest, ties by id) is put back for the
    # burst, and it serves it: no instance is started or released, and no second one drained meanwhile.
    ids, cluster = autoscaled_ids(park_s=300.0)
    assert flags[:2] == [("i003", True), ("i003", False)]
    assert ids == ["i000", "i001", "i002", "i003"] and not cluster.released
    assert any(r.instance_id == "i003" and r.arrival_time > 60.0 for r in cluster.requests)


def test_a_burst_starts_several_instances_at_one_decision() -> None:
    # One instance, then M-M at 12 req/s: the demand one start-up ahead needs more than one more
    # instance, and they are started together rather than one per autoscaling interval.
    scaling = AutoscalingConfig(min_instances=1, max_instances=8, interval_s=10.0)
    burst = generate_trace("M-M", 300, rate=12.0, seed=3)
    config = SimConfig(autoscaling=scaling)
    counts = Cluster(burst, system("llumnix"), PROFILE, instances=1, config=config).run().instance_counts
    assert max(after - before for before, after in pairwise(counts)) >= 2


def test_chunked_prefill_serves_every_request(audited: Counter[str]) -> None:
    trace = heavy_trace(200)
    result = Cluster(trace, system("llumnix"), PROFILE, 4, config=SimConfig(chunked_prefill_tokens=512)).run()
    assert len(audited) == 200 and result.summary()["finished"] == 200


def test_fragmentation_is_sampled_each_interval() -> None:
    result = Cluster(heavy_trace(), system("round-robin"), PROFILE, instances=4).run()
    steps = [b - a for a, b in zip(result.fragmentation_times, result.fragmentation_times[1:], strict=False)]
    assert steps and max(steps) == pytest.approx(SimConfig().migration_interval_s)
    assert all(0.0 <= f < 1.0 for f in result.fragmentation) and max(result.fragmentation) > 0


def test_a_request_larger_than_an_instance_is_a_clear_error() -> None:
    trace = [TraceRequest(0, 0.0, 20_000, 10)]
    with pytest.raises(ValueError, match="KV capacity"):
        Cluster(trace, system("llumnix"), PROFILE, instances=2)


def test_a_router_that_holds_a_burst_lets_small_requests_pass_a_large_one_that_does_not_fit() -> None:
    # Two instances nearly full (about 780 of 851 blocks each); a 6,000-token prompt (375 blocks) fits
    # on neither, the 100-token ones behind it do. Held in arrival order, they would wait for it.
    fillers = [TraceRequest(i, 0.0, 12_000, 400) for i in range(2)]
    large = TraceRequest(2, 5.0, 6_000, 10)  # the fillers are decoding by then
    small = [TraceRequest(3 + i, 5.1 + i * 0.01, 100, 10) for i in range(8)]
    cluster = Cluster([*fillers, large, *small], system("llumnix"), PROFILE, instances=2)
    assert cluster.system.holds
    result = cluster.run()
    by_id = {int(r.request_id): r for r in result.requests}
    assert all(r.finish_time > 0 for r in result.requests)
    for t in small:
        assert by_id[t.request_id].first_token_time - t.arrival_time < 1.0
    assert by_id[2].first_token_time > max(by_id[t.request_id].finish_time for t in small)
