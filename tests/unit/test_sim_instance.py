"""The simulated vLLM instance and the migration state machine, driven step by step."""

from __future__ import annotations

import pytest

from llumnix.load import RequestLoad, engine_queues
from llumnix.profile import RooflineLatency, load_profile
from llumnix.sim.instance import EngineConfig, SimInstance
from llumnix.sim.migration import Migration, Outcome
from llumnix.sim.request import FINISHED, RESUMING, RUNNING, SUSPENDED, WAITING, SimRequest

LATENCY = RooflineLatency(
    weights_read_s=0.02,
    linear_s_per_token=1e-4,
    prefill_attention_s_per_square_token=0.0,
    decode_attention_s_per_context_token=0.0,
    overhead_s=0.0,
)
PROFILE = load_profile()


def instance(name: str = "a", blocks: int = 100, chunked: bool = False, passing: bool = False) -> SimInstance:
    config = EngineConfig(total_blocks=blocks, block_size=16, watermark=0.0,
                          chunked_prefill_tokens=512 if chunked else 0, queue_passing=passing)
    return SimInstance(name, config, LATENCY.iteration_time)


def request(rid: str, prompt: int, output: int, arrival: float = 0.0, high: bool = False) -> SimRequest:
    return SimRequest(rid, arrival, prompt, output, trace_high_priority=high, high_priority=high)


def step(inst: SimInstance, now: float) -> tuple[float, list[SimRequest]]:
    duration = inst.plan(now)
    assert duration is not None
    now += duration
    finished = inst.complete(now)
    inst.check_blocks()
    return now, finished


def test_prefill_then_decode_to_completion_returns_every_block() -> None:
    inst = instance()
    r = request("r", prompt=40, output=5)
    inst.enqueue(r)
    now, _ = step(inst, 0.0)  # prefill: 3 blocks, first token
    assert r.state == RUNNING and r.generated == 1 and r.blocks == 3
    assert r.first_token_time == pytest.approx(0.02)  # weight reading dominates 40 tokens
    finished: list[SimRequest] = []
    while not finished:
        now, finished = step(inst, now)
    assert finished == [r] and r.state == FINISHED and r.generated == 5
    assert inst.free_blocks == 100 and inst.plan(now) is None


def test_decode_preempts_latest_arrival_and_recompute_accounts_loss() -> None:
    inst = instance(blocks=4)
    early = request("early", prompt=32, output=20, arrival=0.0)
    late = request("late", prompt=32, output=20, arrival=1.0)
    inst.enqueue(early)
    inst.enqueue(late)
    now, _ = step(inst, 0.0)  # both prefilled: 2 blocks each, none free
    assert inst.free_blocks == 0
    now, _ = step(inst, now)  # both need a third block: the later arrival is preempted
    assert late.state == WAITING and late.blocks == 0 and late.preemptions == 1
    assert early.blocks == 3 and inst.preemptions == 1
    while early.state != FINISHED:
        now, _ = step(inst, now)
    while late.state == WAITING:
        now, _ = step(inst, now)
    # Recompute prefilled prompt + generated tokens and produced the next one.
    assert late.generated == 2 and late.preemption_loss > 0 and late.preempted_at < 0


@pytest.mark.parametrize("passing", [False, True])
def test_a_head_that_does_not_fit_blocks_the_queue_unless_requests_may_pass(passing: bool) -> None:
    inst = instance(blocks=6, passing=passing)
    inst.enqueue(request("running", prompt=48, output=40))
    step(inst, 0.0)  # 3 of 6 blocks held
    inst.enqueue(large := request("large", prompt=64, output=4, arrival=1.0))  # 4 blocks: does not fit
    inst.enqueue(small := request("small", prompt=16, output=4, arrival=2.0))  # 1 block: fits
    step(inst, 1.0)
    assert large.state == WAITING
    assert small.state == (RUNNING if passing else WAITING)
    assert [r.request_id for r in inst.waiting] == (["large"] if passing else ["large", "small"])


def test_high_priority_is_admitted_first_and_preempted_last() -> None:
    inst = instance(blocks=4)
    normal = request("normal", prompt=32, output=40, arrival=0.0)
    high = request("high", prompt=32, output=40, arrival=1.0, high=True)
    inst.enqueue(normal)
    inst.enqueue(high)
    assert [r.request_id for r in inst.waiting] == ["high", "normal"]
    now, _ = step(inst, 0.0)
    now, _ = step(inst, now)
    # The later arrival is high priority, so the normal request is the victim.
    assert normal.state == WAITING and high.blocks == 3


def test_snapshot_reports_requests_blocks_and_is_cached() -> None:
    inst = instance()
    inst.enqueue(request("r1", prompt=40, output=5))
    step(inst, 0.0)
    inst.enqueue(request("r2", prompt=100, output=5))
    load = inst.snapshot()
    assert load is inst.snapshot()
    assert [r.request_id for r in load.running] == ["r1"] and load.running[0].blocks == 3
    assert [r.request_id for r in load.waiting] == ["r2"] and load.free_blocks == 97


@pytest.mark.parametrize("prompt_blocks", [2, 3])
def test_the_snapshot_offers_only_the_room_the_engine_admits_into(prompt_blocks: int) -> None:
    """The engine keeps a watermark free when it admits a prompt (5 of 100 blocks here). A snapshot
    that counted those blocks as room would have the router send a request the engine then queues
    (7 free: a 3-block prompt waits) and migration fill an instance to where nothing is admitted."""
    config = EngineConfig(total_blocks=100, block_size=16, watermark=0.05)
    inst = SimInstance("a", config, LATENCY.iteration_time)
    inst.enqueue(request("big", prompt=93 * 16, output=50))
    step(inst, 0.0)
    assert inst.free_blocks == 7
    load = inst.snapshot()
    assert (load.total_blocks, load.free_blocks) == (95, 2)
    incoming = request("next", prompt=prompt_blocks * 16, output=5)
    inst.enqueue(incoming)
    step(inst, 1.0)
    engine_queued = incoming.state == WAITING
    assert engine_queued == (prompt_blocks == 3)
    assert engine_queues(load, RequestLoad("next", prompt_blocks * 16, 0)) == engine_queued


def test_chunked_prefill_spreads_a_long_prompt_over_iterations_alongside_decodes() -> None:
    inst = instance(chunked=True)
    short = request("short", prompt=10, output=50)
    inst.enqueue(short)
    now, _ = step(inst, 0.0)
    long = request("long", prompt=1200, output=3)
    inst.enqueue(long)
    now, _ = step(inst, now)  # one decode + a 511-token chunk
    assert short.generated == 2 and long.prefilled == 511 and long.first_token_time < 0
    now, _ = step(inst, now)
    now, _ = step(inst, now)
    assert long.state == RUNNING and long.first_token_time == now and short.generated == 4


def running_instance(prompt: int) -> tuple[SimInstance, SimRequest]:
    src = instance("src")
    r = request("r", prompt=prompt, output=500)
    src.enqueue(r)
    step(src, 0.0)
    return src, r


def test_migration_moves_the_request_with_a_downtime_of_the_final_copy() -> None:
    src, r = running_instance(prompt=1000)
    dst = instance("dst")
    migration = Migration(r, src, dst, PROFILE.kv_transfer_time, max_stages=8)
    first_end = migration.start(1.0)
    assert first_end == pytest.approx(1.0 + PROFILE.kv_transfer_time(1001))
    assert dst.reserved_blocks == r.blocks + 1 and src.migrating_out == 1 and dst.migrating_in == 1
    final_end = migration.on_stage_end(first_end)  # 1001 tokens: 62 full blocks sent, 9 tokens left
    assert r.state == SUSPENDED and final_end == pytest.approx(first_end + PROFILE.kv_transfer_time(9))
    assert migration.on_stage_end(final_end) is None
    assert migration.outcome is Outcome.COMPLETED and migration.stages == 2
    assert migration.downtime == pytest.approx(PROFILE.kv_transfer_time(9))
    assert r.instance_id == "dst" and r.state == RESUMING and r.generated == 1
    assert src.free_blocks == 100 and src.num_requests == 0
    assert dst.reserved_blocks == 0 and dst.free_blocks == 100 - r.blocks
    src.check_blocks()
    dst.check_blocks()
    step(dst, final_end)
    assert r.state == RUNNING and r.generated == 2


def test_migration_aborts_cleanly_when_the_request_finishes_first() -> None:
    src = instance("src")
    r = request("r", prompt=1000, output=2)
    src.enqueue(r)
    now, _ = step(src, 0.0)
    dst = instance("dst")
    migration = Migration(r, src, dst, PROFILE.kv_transfer_time, max_stages=8)
    stage_end = migration.start(now)
    now, finished = step(src, now)
    assert finished == [r]
    assert stage_end is not None and migration.on_stage_end(max(now, stage_end)) is None
    assert migration.outcome is Outcome.ABORTED and dst.free_blocks == 100 and dst.reserved_blocks == 0
    assert src.migrating_out == 0 and dst.migrating_in == 0


def test_migration_aborts_and_the_request_stays_when_the_destination_fills_up() -> None:
    src, r = running_instance(prompt=1000)
    dst = instance("dst")
    migration = Migration(r, src, dst, PROFILE.kv_transfer_time, max_stages=8)
    stage_end = migration.start(1.0)
    assert stage_end is not None
    dst.free_blocks -= dst.free_blocks  # everything else taken meanwhile
    r.generated += 40  # the request grew beyond its reservation while the copy ran
    src.running.remove(r)
    src.running.append(r)
    assert migration.on_stage_end(stage_end) is None
    assert migration.outcome is Outcome.ABORTED and r.state == RUNNING and r.instance_id == "src"
