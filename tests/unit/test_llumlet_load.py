"""The llumlet's live load: snapshots (or the /metrics fallback) + its request book -> LoadReport."""

from __future__ import annotations

import asyncio
import math

import pytest

from llumlet.engine_metrics import MetricsFormatError, parse_engine_metrics
from llumlet.load_tracker import LoadTracker, load_key
from llumlet.requests import RequestRecord, RequestTable
from llumnix.load import freeness, virtual_usage
from llumnix.openai_stream import EndpointKind, GenerationChunk
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot
from llumnix.wire import LoadSource

NOW = 1_000_000.0


def _snapshot(step: int, free: int = 900, running: tuple[EngineRequest, ...] = (),
              waiting: tuple[EngineRequest, ...] = (), preemptions: int = 0,
              t: float = NOW) -> EngineSnapshot:
    return EngineSnapshot(schema_version=1, engine_id="e", step=step, timestamp=t, total_blocks=1000,
                          free_blocks=free, block_size=32, running=running, waiting=waiting,
                          preemptions_total=preemptions)


def _req(rid: str, prompt: int, output: int = 0, blocks: int = 0) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_tokens=prompt, output_tokens=output, blocks=blocks)


def _record(rid: str, prompt: list[int] | str, high: bool = False, at: float = NOW) -> RequestRecord:
    return RequestRecord(rid, EndpointKind.COMPLETION, {"prompt": prompt, "max_tokens": 8}, high, at)


METRICS_TEXT = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2000"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 4.0
"""


def test_load_from_snapshot_matches_the_load_model() -> None:
    tracker = LoadTracker("i", RequestTable())
    tracker.on_snapshot(_snapshot(1, free=900, running=(_req("a", 64, 10, 3),), waiting=(_req("b", 200),)),
                        received_at=NOW)
    report = tracker.report(now=NOW + 0.01)
    assert report is not None
    assert report.source is LoadSource.CONNECTOR
    assert [r.request_id for r in report.load.running] == ["a"]
    assert [r.request_id for r in report.load.waiting] == ["b"]
    # 100 used + head of line (200 tokens = 7 blocks of 32) over a batch of 2.
    assert report.virtual_usage == virtual_usage(report.load) == 107
    assert report.freeness == freeness(report.load) == pytest.approx((1000 - 107) / 2)
    assert report.snapshot_age_s == pytest.approx(0.01)


def test_admitted_requests_count_before_the_engine_queues_them() -> None:
    table = RequestTable()
    tracker = LoadTracker("i", table)
    tracker.on_snapshot(_snapshot(1), received_at=NOW)
    idle = tracker.report(now=NOW)
    table.add(_record("new", list(range(320))))
    busy = tracker.report(now=NOW)
    assert [r.request_id for r in busy.load.waiting] == ["new"]
    assert busy.virtual_usage == idle.virtual_usage + 10  # 320 prompt tokens / 32 per block
    assert busy.freeness < idle.freeness
    # Once the engine lists the request, it is counted once, from the engine's numbers.
    tracker.on_snapshot(_snapshot(2, running=(_req("new", 320, 1, 11),), free=889), received_at=NOW)
    assert [r.request_id for r in tracker.report(now=NOW).load.running] == ["new"]
    assert tracker.report(now=NOW).load.waiting == ()


def test_high_priority_is_marked_from_the_llumlets_book() -> None:
    table = RequestTable()
    table.add(_record("vip", [1, 2, 3], high=True))
    tracker = LoadTracker("i", table)
    tracker.on_snapshot(_snapshot(1, running=(_req("vip", 3, 1, 1), _req("other", 3, 1, 1))), received_at=NOW)
    report = tracker.report(now=NOW)
    assert {r.request_id: r.high_priority for r in report.load.running} == {"vip": True, "other": False}
    # 1600 tokens of target load at 32 per block = 50 blocks; the rest of the 1000 is headroom.
    assert report.virtual_usage == 100 + (1000 - 50)


def test_draining_reports_infinite_usage() -> None:
    tracker = LoadTracker("i", RequestTable())
    tracker.on_snapshot(_snapshot(1), received_at=NOW)
    tracker.draining = True
    report = tracker.report(now=NOW)
    assert report.load.draining
    assert report.virtual_usage == math.inf
    assert report.freeness == -math.inf


def test_preemptions_are_differences_between_snapshots_and_old_steps_are_ignored() -> None:
    tracker = LoadTracker("i", RequestTable())
    tracker.on_snapshot(_snapshot(1, preemptions=5), received_at=NOW)
    assert tracker.report(now=NOW).load.preemptions == 0
    tracker.on_snapshot(_snapshot(3, preemptions=7, free=500), received_at=NOW)
    assert tracker.report(now=NOW).load.preemptions == 2
    tracker.on_snapshot(_snapshot(2, free=100), received_at=NOW)  # reordered: dropped
    assert tracker.report(now=NOW).load.free_blocks == 500


def test_idle_engine_keeps_connector_source_without_new_snapshots() -> None:
    tracker = LoadTracker("i", RequestTable(), snapshot_timeout_s=2.0)
    tracker.on_snapshot(_snapshot(1), received_at=NOW)
    idle_metrics = METRICS_TEXT.replace('model_name="tiny"} 1.0', 'model_name="tiny"} 0.0')
    tracker.on_metrics(parse_engine_metrics(idle_metrics), observed_at=NOW + 60)
    assert not tracker.snapshot_health(now=NOW + 60).stalled
    assert tracker.report(now=NOW + 60).source is LoadSource.CONNECTOR


def test_falls_back_to_metrics_when_snapshots_stop_under_load() -> None:
    table = RequestTable()
    tracker = LoadTracker("i", table, snapshot_timeout_s=2.0)
    tracker.on_snapshot(_snapshot(1), received_at=NOW)
    started = _record("a", list(range(64)), at=NOW + 1)
    started.observe(GenerationChunk(token_ids=(7, 8), prompt_token_ids=tuple(range(64))))
    table.add(started)
    table.add(_record("b", list(range(100)), at=NOW + 1))
    assert not tracker.snapshot_health(now=NOW + 2.5).stalled  # the request is young
    tracker.on_metrics(parse_engine_metrics(METRICS_TEXT), observed_at=NOW + 4)
    health = tracker.snapshot_health(now=NOW + 4)
    assert health.stalled and health.age_s == pytest.approx(4)
    report = tracker.report(now=NOW + 4)
    assert report.source is LoadSource.METRICS_FALLBACK
    assert (report.load.total_blocks, report.load.free_blocks, report.load.block_size) == (2000, 1500, 32)
    assert [(r.request_id, r.output_tokens, r.blocks) for r in report.load.running] == [("a", 2, 3)]
    assert [(r.request_id, r.prompt_tokens) for r in report.load.waiting] == [("b", 100)]
    # A snapshot brings the connector back.
    tracker.on_snapshot(_snapshot(2, t=NOW + 4.1), received_at=NOW + 4.1)
    assert tracker.report(now=NOW + 4.2).source is LoadSource.CONNECTOR


def test_without_any_observation_there_is_no_load() -> None:
    assert LoadTracker("i", RequestTable()).report() is None


def test_load_key_ignores_age_and_sequence() -> None:
    tracker = LoadTracker("i", RequestTable())
    tracker.on_snapshot(_snapshot(1), received_at=NOW)
    first, second = tracker.report(now=NOW), tracker.report(now=NOW + 0.5)
    assert first.sequence < second.sequence
    assert load_key(first) == load_key(second)
    tracker.on_snapshot(_snapshot(2, free=899), received_at=NOW)
    assert load_key(tracker.report(now=NOW)) != load_key(first)


async def test_every_waiter_sees_a_change_and_quiet_waits_time_out() -> None:
    tracker = LoadTracker("i", RequestTable())
    seen = tracker.version
    assert await tracker.wait_for_change(seen, 0.01) == seen
    asyncio.get_running_loop().call_later(0.01, tracker.on_snapshot, _snapshot(1))
    first, second = await asyncio.gather(tracker.wait_for_change(seen, 1.0),
                                         tracker.wait_for_change(seen, 1.0))
    assert first == second > seen
    # A change that happened before the wait returns at once.
    tracker.draining = True
    assert await tracker.wait_for_change(first, 0) > first


def test_metrics_parser_needs_the_cache_config() -> None:
    metrics = parse_engine_metrics(METRICS_TEXT)
    assert (metrics.total_blocks, metrics.free_blocks, metrics.running, metrics.waiting,
            metrics.preemptions_total) == (2000, 1500, 1, 1, 4)
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics("vllm:num_requests_running 1\n")


def test_whether_the_engine_ran_a_request_after_a_moment_comes_from_a_later_snapshot_only() -> None:
    tracker = LoadTracker("i", RequestTable())
    assert not tracker.engine_runs("a", since=NOW)  # no snapshot yet
    tracker.on_snapshot(_snapshot(1, running=(_req("a", 64, 3, 3),), waiting=(_req("b", 10),), t=NOW))
    assert not tracker.engine_runs("a", since=NOW)  # taken at, not after, that moment
    tracker.on_snapshot(_snapshot(2, running=(_req("a", 64, 4, 3),), waiting=(_req("b", 10),), t=NOW + 0.01))
    assert tracker.engine_runs("a", since=NOW)
    assert not tracker.engine_runs("b", since=NOW)  # waiting, not running
    assert not tracker.engine_runs("a", since=NOW + 0.01)
    tracker.on_snapshot(_snapshot(3, t=NOW + 0.02))  # finished there
    assert not tracker.engine_runs("a", since=NOW)
