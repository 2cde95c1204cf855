"""The sim engine's settings as `llumnix sim-engine` takes them: the admission watermark it keeps (vLLM
v0's 1% by default, none with `--watermark 0` as vLLM 0.32's default) is what its snapshots leave out,
and settings that cannot work are messages."""

from __future__ import annotations

import pytest

from llumnix.sim_engine.server import SimEngineConfig, build_engine
from llumnix.sim_engine.snapshot import capture_state


@pytest.mark.parametrize(("watermark", "offered"), [(0.0, 100), (0.01, 99), (0.1, 90)])
def test_the_snapshot_leaves_out_the_watermark_the_engine_keeps(watermark: float, offered: int) -> None:
    engine, _ = build_engine(SimEngineConfig(num_blocks=100, block_size=16, max_model_len=512,
                                             watermark=watermark), None)
    state = capture_state(engine.instance, {}, 0.0)
    assert state.total_blocks == state.free_blocks == offered


@pytest.mark.parametrize("watermark", [-0.01, 1.0])
def test_a_watermark_outside_the_blocks_is_a_message(watermark: float) -> None:
    with pytest.raises(ValueError, match="watermark is a share of the blocks"):
        build_engine(SimEngineConfig(num_blocks=100, block_size=16, watermark=watermark), None)


def test_a_context_longer_than_the_pool_above_the_watermark_is_a_message() -> None:
    # 100 blocks of 16 tokens hold 1,600 tokens; a 10% watermark leaves 1,440 for a sequence.
    build_engine(SimEngineConfig(num_blocks=100, block_size=16, max_model_len=1440, watermark=0.1), None)
    with pytest.raises(ValueError, match="leave 1440 tokens above the 10% admission watermark"):
        build_engine(SimEngineConfig(num_blocks=100, block_size=16, max_model_len=1456, watermark=0.1), None)
