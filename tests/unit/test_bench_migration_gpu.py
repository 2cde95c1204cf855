"""bench/migration_gpu.py's CPU-side logic (it runs on GPU machines, not here): the channel it takes for
two engines, the export commands it sends, its stage marks and the report that says what it measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from llumnix.engine.handshake import migration_key, new_kv_secret
from llumnix.v1.kv_transfer_pb2 import EngineCommand, ExportStage, KVChannel, MigrationEvent

CPU = {"kv_channels": ["tcp", "gloo"]}
CUDA = {"kv_channels": ["tcp", "gloo", "nccl"]}
DESTINATION = {"kv_address": "tcp://10.0.0.7:4000", "kv_secret": new_kv_secret()}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = Path(__file__).parents[2] / "bench" / "migration_gpu.py"
    spec = importlib.util.spec_from_file_location("migration_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_auto_takes_nccl_between_cuda_engines_and_tcp_otherwise(bench: ModuleType) -> None:
    assert bench.negotiate("auto", CUDA, CUDA) == "nccl"
    assert bench.negotiate("auto", CUDA, CPU) == "tcp"
    assert bench.negotiate("gloo", CPU, CPU) == "gloo"
    with pytest.raises(ValueError, match=r"nccl .*needs a CUDA GPU on both engines"):
        bench.negotiate("nccl", CUDA, CPU)


def test_export_commands_carry_the_channel_the_destination_opened(bench: ModuleType) -> None:
    channel = KVChannel(backend="nccl", channel_id="c", nccl_unique_id=bytes(128))
    fields = bench.export_fields("m", DESTINATION, "nccl", channel)
    command = EngineCommand(schema_version=1, export_stage=ExportStage(**fields))
    assert command.export_stage.channel == channel and command.export_stage.transport == "nccl"
    assert command.export_stage.kv_key == migration_key(DESTINATION["kv_secret"], "m")
    assert "channel" not in bench.export_fields("m", DESTINATION, "tcp", None)


def test_stages_are_spread_before_the_final_one(bench: ModuleType) -> None:
    assert bench.stage_marks(128, 2) == [42, 85, 128]
    assert bench.stage_marks(100, 0) == [100]


def test_the_report_says_what_was_measured(bench: ModuleType) -> None:
    def stage(copy_ms: float, send_ms: float, final: bool = False) -> MigrationEvent:
        return MigrationEvent(copy_ms=copy_ms, send_ms=send_ms, blocks=2, bytes=2 << 20, final=final)

    results = [{"stages": [stage(0.5, 30.0), stage(0.4, 2.0), stage(0.3, 1.0, True)],
                "loaded": MigrationEvent(copy_ms=0.7), "downtime_ms": 12.5, "exact": True}]
    lines = bench.report(results, "1 migration A -> B on gpu over nccl")
    assert lines[0] == "measured: 1 migration A -> B on gpu over nccl"
    assert lines[2].split()[-2:] == ["12.5", "True"] and "2.00" in lines[2]  # 2 MiB final stage
    assert lines[-1].startswith("median: live stage send 16.00 ms (the first includes the channel's setup)")
    assert lines[-1].endswith("downtime 12.5 ms; exact 1/1")
