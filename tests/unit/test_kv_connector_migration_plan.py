"""The connector's scheduler-side migration bookkeeping: command validation, which blocks each stage
carries (full blocks once, the partial tail again), the final stage on finish, cancellation."""

from llumnix.engine.kv_migration_plan import MigrationPlan
from llumnix.v1.kv_transfer_pb2 import CancelExport, DropStaging, EngineCommand, ExportFinal, ExportStage

BLOCK = 32


def _stage(migration: str, request: str, address: str = "tcp://d:1") -> EngineCommand:
    return EngineCommand(schema_version=1, export_stage=ExportStage(
        migration_id=migration, request_id=request, kv_address=address))


def _final(migration: str, request: str) -> EngineCommand:
    return EngineCommand(schema_version=1, export_final=ExportFinal(
        migration_id=migration, request_id=request, kv_address="tcp://d:1", transport="tcp"))


def _plan() -> tuple[MigrationPlan, list[str]]:
    drops: list[str] = []
    plan = MigrationPlan(BLOCK, drops.append)
    plan.track("r1", "engine-r1")
    return plan, drops


BLOCKS = list(range(100, 110))


def test_stages_send_full_blocks_once_and_the_tail_again() -> None:
    plan, _ = _plan()
    assert plan.handle(_stage("m", "r1")).ok
    [first] = plan.take_stages(lambda engine_id: (BLOCKS, 70) if engine_id == "engine-r1" else None)
    assert (first.stage, first.first_block, first.block_ids, first.num_tokens) == (1, 0, (100, 101, 102), 70)
    assert first.engine_request_id == "engine-r1" and not first.final
    assert first.destination.transport == "tcp" and first.destination.kv_address == "tcp://d:1"
    assert plan.take_stages(lambda _: (BLOCKS, 80)) == []  # nothing requested
    plan.handle(_stage("m", "r1"))
    [second] = plan.take_stages(lambda _: (BLOCKS, 130))
    # Tokens 64..69 sat in the partial block 2: it is re-sent with the new blocks 3 and 4.
    assert (second.stage, second.first_block, second.block_ids) == (2, 2, (102, 103, 104))
    assert plan.handle(_final("m", "r1")).ok
    final = plan.final_export("r1", "engine-r1", BLOCKS[:5], 140)
    assert final is not None and final.final and final.stage == 3
    assert (final.first_block, final.block_ids, final.num_tokens) == (4, (104,), 140)


def test_a_stage_waits_for_a_step_that_schedules_the_request() -> None:
    plan, _ = _plan()
    plan.handle(_stage("m", "r1"))
    assert plan.take_stages(lambda _: None) == []  # preempted this step
    [item] = plan.take_stages(lambda _: (BLOCKS, 33))
    assert item.block_ids == (100, 101)


def test_commands_for_unknown_requests_or_without_destination_are_refused() -> None:
    plan, _ = _plan()
    reply = plan.handle(_stage("m", "nobody"))
    assert not reply.ok and "unknown request 'nobody'" in reply.error
    assert not plan.handle(_stage("m", "r1", address="")).ok
    plan.track("r2", "engine-r2")
    assert plan.handle(_stage("m", "r1")).ok
    clash = plan.handle(_stage("m", "r2"))
    assert not clash.ok and "exports 'r1'" in clash.error
    assert not plan.handle(EngineCommand(schema_version=1)).ok


def test_a_finished_request_without_export_final_frees_normally_and_is_forgotten() -> None:
    plan, _ = _plan()
    plan.handle(_stage("m", "r1"))
    assert plan.final_export("r1", "engine-r1", BLOCKS, 100) is None
    assert plan.take_stages(lambda _: (BLOCKS, 100)) == []
    assert not plan.handle(_stage("m", "r1")).ok  # no longer running here


def test_cancel_forgets_and_drop_is_forwarded() -> None:
    plan, drops = _plan()
    plan.handle(_final("m", "r1"))
    plan.handle(_stage("m", "r1"))
    assert plan.handle(EngineCommand(schema_version=1, cancel_export=CancelExport(migration_id="m"))).ok
    assert plan.take_stages(lambda _: (BLOCKS, 100)) == []
    assert plan.final_export("r1", "engine-r1", BLOCKS, 100) is None
    assert plan.handle(EngineCommand(schema_version=1, drop_staging=DropStaging(migration_id="x"))).ok
    assert drops == ["x"]


def test_final_without_earlier_stages_sends_everything() -> None:
    plan, _ = _plan()
    plan.handle(_final("m", "r1"))
    final = plan.final_export("r1", "engine-r1", BLOCKS[:3], 65)
    assert final is not None and (final.stage, final.first_block, final.block_ids) == (1, 0, (100, 101, 102))
