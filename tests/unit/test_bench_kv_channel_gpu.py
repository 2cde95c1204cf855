"""bench/kv_channel_gpu.py on CPU with the tiny shape: a request's blocks go out of one paged cache, over
tcp and gloo (the connector's transports), into another cache byte for byte; NCCL's refusal off CUDA is
reported, not raised; the report says what was measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from llumnix.engine.kv_blocks import KVBlockCopier

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_channel_gpu", BENCH / "kv_channel_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def copiers(bench: ModuleType, blocks: int) -> tuple[KVBlockCopier, KVBlockCopier]:
    return tuple(KVBlockCopier(bench.kv_caches("tiny", blocks, "cpu", torch.float32), blocks) for _ in "ab")


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_blocks_arrive_byte_for_byte_in_the_other_cache(bench: ModuleType, backend: str) -> None:
    source, destination = copiers(bench, 9)
    rows, outcome = bench.measure_channel(backend, source, destination, [64, 128], "cpu", budget_s=60)
    assert outcome.startswith("ok (the first move, of 128 tokens, allocating: ")
    assert [(r["channel"], r["tokens"], r["blocks"]) for r in rows] == [(backend, 64, 4), (backend, 128, 8)]
    assert all(r["equal"] for r in rows)
    assert rows[1]["bytes"] == 8 * source.layout.bytes_per_block == 128 * 2 * 2 * 2 * 32 * 4
    assert torch.equal(destination.copy_out_block_major(range(8)), source.copy_out_block_major(range(8)))


def test_nccl_off_cuda_is_reported_with_its_reason(bench: ModuleType) -> None:
    source, destination = copiers(bench, 5)
    rows, outcome = bench.measure_channel("nccl", source, destination, [64], "cpu", budget_s=60)
    assert rows == [] and "needs a CUDA GPU" in outcome


def test_the_report_names_every_channels_outcome(bench: ModuleType) -> None:
    source, destination = copiers(bench, 5)
    rows, outcome = bench.measure_channel("tcp", source, destination, [64], "cpu", budget_s=60)
    text = bench.markdown(
        {
            "device_name": "cpu",
            "shape": "tiny",
            "bytes_per_token": 512,
            "dtype": "float32",
            "torch": torch.__version__,
            "moves": rows,
            "channels": {"tcp": outcome, "nccl": "KVTransportError: one GPU"},
        }
    )
    assert "| tcp | 64 |" in text and "- nccl: KVTransportError: one GPU" in text
