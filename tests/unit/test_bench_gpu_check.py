"""bench/gpu_check.py's parts that need no engine: the random model it writes (a directory transformers
loads), the phase budgets (a phase that runs out is reported, the run goes on), the decode-step and
profile arithmetic, and the report. The whole run on CPU vLLM is tests/integration/test_gpu_check.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from script_module import load_bench

from llumnix.profile import profile_from_dict
from llumnix.tiny_model import PRESETS


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return load_bench("gpu_check")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_random_model_is_a_sharded_directory_transformers_loads(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(gpu_check, "SHARD_BYTES", 200_000)  # several shards for a tiny model
    recipe = dataclasses.replace(PRESETS["test"], dtype=dtype)
    record = gpu_check.write_random_llama(tmp_path / "m", recipe, "cpu")
    assert record["shards"] > 1
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == record["shards"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m", torch_dtype=getattr(torch, dtype))
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert model.config.num_hidden_layers == recipe.layers and model.config.vocab_size == record["vocab_size"]
    weights = model.model.layers[0].self_attn.q_proj.weight
    assert weights.dtype == getattr(torch, dtype) and 0.015 < float(weights.detach().float().std()) < 0.025
    assert torch.all(model.model.norm.weight == 1)


def test_the_7b_shape_is_llama_7bs(gpu_check: ModuleType) -> None:
    shapes = gpu_check.llama_tensor_shapes(gpu_check.LLAMA_7B, 32000)
    parameters = sum(gpu_check._numel(s) for s in shapes.values())
    assert 6.7e9 < parameters < 6.8e9  # LLaMA-7B: 6.74e9
    assert shapes["model.layers.31.mlp.down_proj.weight"] == (4096, 11008)


def test_a_built_model_is_reused(gpu_check: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path, record = gpu_check.ensure_random_llama(tmp_path, PRESETS["test"], "cpu")
    again, reused = gpu_check.ensure_random_llama(tmp_path, PRESETS["test"], "cpu")
    assert again == path and reused["reused"] and not record.get("reused")


async def test_a_phase_that_runs_out_is_reported_and_the_next_one_runs(gpu_check: ModuleType) -> None:
    phases = gpu_check.Phases(total_s=60, reserve_s=0)
    never = asyncio.Event()
    assert await phases.run("stuck", 0.05, never.wait) is None

    async def broken() -> None:
        raise RuntimeError("engine exited")

    async def fine() -> int:
        return 7

    assert await phases.run("broken", 10, broken) is None
    assert await phases.run("fine", 10, fine) == 7
    statuses = {r.name: (r.status, r.detail) for r in phases.results}
    assert statuses["stuck"][0] == "timed out" and statuses["broken"] == (
        "failed",
        "RuntimeError: engine exited",
    )
    assert statuses["fine"][0] == "ok" and phases.ok("fine") and not phases.ok("stuck")


async def test_no_phase_runs_past_the_overall_budget(gpu_check: ModuleType) -> None:
    phases = gpu_check.Phases(total_s=10, reserve_s=10)

    async def fine() -> None:
        return None

    await phases.run("late", 100, fine)
    assert (phases.results[0].status, phases.results[0].detail) == ("skipped", "the overall budget was spent")


def test_decode_step_is_measured_while_the_whole_batch_decodes(gpu_check: ModuleType) -> None:
    # Two streams, 10 ms steps; the second starts two steps late and ends two early.
    first = [0.00, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
    second = [0.02, 0.03, 0.04]
    assert gpu_check.decode_step_s([first, second]) == pytest.approx(0.01)


def test_decode_cells_that_cannot_occur_take_the_nearest_that_fits(gpu_check: ModuleType) -> None:
    plan = gpu_check.GPU_PLAN
    assert gpu_check.decode_cell(8, 8192, plan) == (1024, False)
    assert gpu_check.decode_cell(128, 1024, plan) == (16, True)
    longest, fitted = gpu_check.decode_cell(1, 32768, plan)
    assert fitted and longest + plan.decode_steps < plan.max_model_len


def test_one_gpu_measures_the_host_channels_and_says_why_nccl_is_skipped(gpu_check: ModuleType) -> None:
    measured, skipped = gpu_check.channels(1, "gpu")
    assert measured == ["tcp", "gloo"] and "one GPU" in skipped["nccl"]
    assert "CUDA" in gpu_check.channels(0, "cpu")[1]["nccl"]


def report(gpu_check: ModuleType) -> dict:
    plan = gpu_check.CPU_PLAN
    measured = {
        "prefill": [{"tokens": t, "seconds": t / 1e4} for t in plan.prefill_tokens],
        "decode": [
            {
                "batch_size": b,
                "context_tokens": c,
                "prompt_tokens_per_sequence": c // b,
                "fitted": False,
                "seconds": 0.01 + b * 1e-4 + c * 1e-6,
            }
            for b in plan.batch_sizes
            for c in plan.context_totals
        ],
    }
    engine = {
        "model": "tiny",
        "device_name": "cpu",
        "vllm": "0.32.0",
        "mode": "CPU dry run",
        "block_size": 32,
        "kv_capacity_tokens": 4096,
        "kv_bytes_per_token": 1024,
        "kv_dtype": "float32",
        "kv_channels": ["tcp", "gloo"],
    }
    migrations = [
        {
            "transport": "tcp",
            "tokens": 512,
            "outcome": "COMMITTED",
            "reason": "",
            "downtime_ms": 5.0,
            "duration_ms": 20.0,
            "stages": 3,
            "bytes": 2 << 20,
            "migrated_tokens": 512,
            "recompute_ms": 40.0,
            "equal": True,
            "compared_tokens": 24,
            "first_difference": None,
            "distinct_tokens": 20,
        }
    ]
    return {
        "environment": {
            "mode": "CPU dry run",
            "device_name": "cpu",
            "gpus": 0,
            "gpu_memory_gib": 0,
            "vllm": "0.32.0",
            "torch": "2.13.0",
            "model": "tiny",
        },
        "plan": dataclasses.asdict(plan),
        "engine": engine,
        "migrations": migrations,
        "skipped_channels": {"nccl": "CPU engines"},
        "router": {},
        "phases": [{"name": "model", "status": "ok", "seconds": 1.0, "budget_s": 60, "detail": ""}],
        "profile_measurements": measured,
        "profile": gpu_check.latency_profile(measured, plan, engine, migrations),
    }


def test_the_measured_profile_is_one_the_simulator_loads(gpu_check: ModuleType) -> None:
    profile = report(gpu_check)["profile"]
    loaded = profile_from_dict(profile)
    assert loaded.block_size == 32 and loaded.kv_capacity_tokens == 4096
    assert loaded.migration_bandwidth == pytest.approx((2 << 20) / 0.02, rel=1e-3)
    assert loaded.prefill_time(128) == pytest.approx(0.0128)
    assert loaded.decode_time(4, 512) == pytest.approx(0.01 + 4e-4 + 512e-6)


def test_the_report_tells_phases_migrations_and_profile(gpu_check: ModuleType, tmp_path: Path) -> None:
    data = report(gpu_check)
    gpu_check.write_reports(data, tmp_path)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| model | ok | 1.0 | 60 |  |" in text
    assert "| tcp | 512 | COMMITTED | 5.0 | 20.0 | 3 | 2.0 | 40.0 | yes, 24 compared, 20 distinct |" in text
    assert "- nccl: skipped: CPU engines" in text and "## Latency profile" in text
    assert json.loads((tmp_path / "gpu_check_profile.json").read_text())["kind"] == "measured"
    assert json.loads((tmp_path / "gpu_check.json").read_text())["migrations"][0]["equal"] is True


def test_without_vllm_it_stops_at_once_and_names_the_vllm_free_check(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(SystemExit, match=r"vLLM is not installed.*kv_channel_gpu\.py"):
        gpu_check.environment(gpu_check.GPU_PLAN)


async def test_a_batch_is_read_until_every_stream_decoded_together(gpu_check: ModuleType) -> None:
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    # A fake engine admitting its requests one after another: each starts only once the one before it
    # streamed 3 tokens; every stream goes on until the client closes it.
    admitted = [asyncio.Event() for _ in range(4)]
    admitted[0].set()
    served = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal served
        index = served
        served += 1
        await admitted[index].wait()
        response = web.StreamResponse()
        await response.prepare(request)
        for token in range(10_000):
            await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            if token == 3 and index + 1 < len(admitted):
                admitted[index + 1].set()
            await asyncio.sleep(0)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app) as server, ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        streams = await gpu_check.batch_streams(session, url, [{"prompt": [1]}] * 4, steps=5)
    together = max(s[0] for s in streams)
    assert all(sum(t >= together for t in s) >= 5 for s in streams)
    assert streams[0][0] < streams[3][0] and gpu_check.decode_step_s(streams) > 0
