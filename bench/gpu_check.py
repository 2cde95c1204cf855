"""The prepared GPU run: on one GPU machine with no network, everything the CPU cannot measure, in one go.

    python bench/gpu_check.py --out OUT          # one CUDA GPU: ~6-8 min, hard limit --budget (480 s)
    python bench/gpu_check.py --cpu --out OUT    # every phase on CPU vLLM with the tiny model (CI, dry run)

Needs only this project with the `gpu` extra (vllm==0.32.0; `--cpu`: the cpu extra); it downloads
nothing. Phases, each with its own time budget inside the overall one (a phase that runs out is reported
as such and the run goes on; nothing waits without a bound):

1. model: a random-weight LLaMA of LLaMA-7B's shape (32 layers, hidden 4096, 32 heads, MLP 11008,
   fp16; the byte-level test tokenizer, so the vocabulary is 447 rather than 32,000: LLaMA-7B's
   embedding and head are 0.5 GB of its 13.5) written as safetensors straight from tensors generated
   on the GPU, without building a model object; reused from --model-cache when already there. `--cpu`:
   the test shape.
2. engines: two vLLM engines sharing the GPU (--gpu-memory-utilization 0.4 each, started one after the
   other: vLLM sizes its KV cache from the device's free memory), each with its llumlet.
3. migration: per KV channel one GPU allows (tcp, gloo: both through host memory; NCCL needs two GPUs,
   reported as skipped on one) and per sequence length (256 -> 8k tokens), one live migration of a greedy
   request through the llumlets' MigrateOut: downtime, duration, bytes, stages; the destination's
   recompute time (prefill of the same length) for comparison; and whether the migrated request's tokens
   equal the same request run without a move.
4. router: output throughput and TTFT through `llumnix router` (both llumlets) against the two engines
   driven directly, same concurrency and requests.
5. profile: prefill time vs prompt tokens and decode step time vs (batch size, context tokens), measured
   on one engine through its API, written as a `"kind": "measured"` latency profile that
   `llumnix simulate --profile OUT/gpu_check_profile.json` loads (docs/latency-profile.md).

Writes OUT/gpu_check.json (everything measured, every phase's status), OUT/gpu_check.md (the report)
and OUT/gpu_check_profile.json. Exit code 0 when every phase completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from migration_downtime import Node
from router_peer import start_service

from llumnix.launch.child_process import ChildProcess
from llumnix.launch.engine_process import EngineLaunchConfig
from llumnix.launch.pair import EnginePair, PairConfig, free_port
from llumnix.profile import profile_from_dict
from llumnix.tiny_model import (
    PRESETS,
    RECIPE_FILE,
    TinyModelRecipe,
    build_tokenizer,
    llama_config,
    read_recipe_record,
)
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb
from llumnix.vllm_support import UnsupportedVllmError, check_vllm_version

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench"
SHARD_BYTES = 2 << 30
"""Safetensors shard size: a shard is held in host memory while it is written."""
INITIALIZER_RANGE = 0.02
"""LLaMA's initialisation (N(0, 0.02)): fp16 activations stay finite through 32 layers."""
LLAMA_7B = TinyModelRecipe(
    layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, dtype="float16", max_position_embeddings=9728
)
PREFILL_REPEATS = 3
"""A prefill is one iteration: the median of a few is its time (decode cells average many steps)."""
TEARDOWN_S = 30.0
"""Kept out of every phase's budget: stopping the engines and writing the reports."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one mode measures, and the time it gets for it."""

    device: str
    recipe: TinyModelRecipe
    max_model_len: int
    lengths: tuple[int, ...]
    decode_before: int
    """Tokens a request generates on the source before it is moved."""
    compared: int
    """Tokens of a migrated request compared with the unmigrated run (before and after the move)."""
    router_concurrency: int
    router_requests: int
    router_prompt: int
    router_output: int
    prefill_tokens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_totals: tuple[int, ...]
    """The decode grid's context axis: tokens of all sequences in the batch together."""
    decode_steps: int
    max_num_seqs: int
    max_num_batched_tokens: int
    budgets: dict[str, float]


GPU_PLAN = Plan(
    device="gpu",
    recipe=LLAMA_7B,
    max_model_len=9472,
    lengths=(256, 1024, 2048, 4096, 8192),
    decode_before=16,
    compared=64,
    router_concurrency=32,
    router_requests=128,
    router_prompt=256,
    router_output=128,
    prefill_tokens=(16, 256, 1024, 2048, 4096, 8192),
    batch_sizes=(1, 8, 32, 128),
    context_totals=(2048, 8192, 32768),
    decode_steps=24,
    max_num_seqs=128,
    max_num_batched_tokens=8192,
    budgets={"model": 90, "engines": 200, "migration": 90, "router": 45, "profile": 60, "total": 480},
)
CPU_PLAN = Plan(
    device="cpu",
    recipe=dataclasses.replace(PRESETS["test"], max_position_embeddings=4096),
    max_model_len=4096,
    lengths=(128, 512),
    decode_before=8,
    compared=24,
    router_concurrency=4,
    router_requests=12,
    router_prompt=32,
    router_output=16,
    prefill_tokens=(16, 128, 512),
    batch_sizes=(1, 4),
    context_totals=(128, 512),
    decode_steps=8,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    budgets={"model": 120, "engines": 600, "migration": 300, "router": 180, "profile": 240, "total": 1500},
)


# ---- the model ----------------------------------------------------------------------------------------


def llama_tensor_shapes(recipe: TinyModelRecipe, vocab: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face LLaMA's parameter names and shapes, in the order they are written."""
    h, q, kv, inter = (
        recipe.hidden,
        recipe.heads * recipe.head_dim,
        recipe.kv_heads * recipe.head_dim,
        recipe.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(recipe.layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (h,),
            f"{layer}.self_attn.q_proj.weight": (q, h),
            f"{layer}.self_attn.k_proj.weight": (kv, h),
            f"{layer}.self_attn.v_proj.weight": (kv, h),
            f"{layer}.self_attn.o_proj.weight": (h, q),
            f"{layer}.post_attention_layernorm.weight": (h,),
            f"{layer}.mlp.gate_proj.weight": (inter, h),
            f"{layer}.mlp.up_proj.weight": (inter, h),
            f"{layer}.mlp.down_proj.weight": (h, inter),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}


def write_random_llama(out_dir: Path, recipe: TinyModelRecipe, device: str) -> dict[str, Any]:
    """A loadable Hugging Face LLaMA directory with random weights: config, tokenizer, sharded safetensors.
    Each tensor is generated in the target dtype on `device` (a GPU makes 7B of them in seconds) and
    copied to host memory one shard at a time; no model object, no fp32 copy."""
    import torch
    from safetensors.torch import save_file

    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, recipe.vocab_size)
    vocab = len(tokenizer)
    config = llama_config(recipe, tokenizer)
    config.initializer_range = INITIALIZER_RANGE
    config.torch_dtype = recipe.dtype
    config.save_pretrained(out_dir)
    dtype = getattr(torch, recipe.dtype)
    generator = torch.Generator(device=device).manual_seed(recipe.seed)
    shapes = llama_tensor_shapes(recipe, vocab)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_bytes = total_bytes = 0
    files: list[dict[str, Any]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append({"file": name, "tensors": len(shard)})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        if len(shape) == 1:  # RMSNorm scales
            tensor = torch.ones(shape, dtype=dtype)
        else:
            tensor = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            tensor = tensor.mul_(INITIALIZER_RANGE).cpu()
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total_bytes += size
    flush()
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=1) + "\n"
    )
    record = {
        "digest": recipe.digest(),
        "writer": "bench/gpu_check.py random normal",
        "recipe": dataclasses.asdict(recipe),
        "vocab_size": vocab,
        "parameters": sum(_numel(s) for s in shapes.values()),
        "bytes": total_bytes,
        "shards": len(files),
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out_dir / RECIPE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def ensure_random_llama(cache: Path, recipe: TinyModelRecipe, device: str) -> tuple[Path, dict[str, Any]]:
    """The model for `recipe` under `cache`, written first unless a complete one is there."""
    target = cache / f"gpu-check-{recipe.digest()}"
    record = read_recipe_record(target)
    if record is not None and record.get("digest") == recipe.digest():
        return target, {**record, "reused": True}
    return target, write_random_llama(target, recipe, device)


# ---- phases and their budgets -------------------------------------------------------------------------


@dataclasses.dataclass
class PhaseResult:
    name: str
    budget_s: float
    status: str = "not run"
    """ok | timed out | failed | skipped"""
    seconds: float = 0.0
    detail: str = ""


class Phases:
    """Runs phases in order, each bounded by its budget and by what is left of the overall one."""

    def __init__(self, total_s: float, reserve_s: float = TEARDOWN_S) -> None:
        self.deadline = time.monotonic() + total_s - reserve_s
        self.results: list[PhaseResult] = []

    def ok(self, name: str) -> bool:
        return any(r.name == name and r.status == "ok" for r in self.results)

    def skip(self, name: str, budget_s: float, why: str) -> None:
        self.results.append(PhaseResult(name, budget_s, "skipped", detail=why))

    async def run(self, name: str, budget_s: float, phase: Callable[[], Awaitable[Any]]) -> Any:
        """The phase's result, or None when it timed out or failed (its status says which)."""
        budget = min(budget_s, self.deadline - time.monotonic())
        result = PhaseResult(name, budget_s)
        self.results.append(result)
        if budget <= 0:
            result.status, result.detail = "skipped", "the overall budget was spent"
            return None
        started = time.monotonic()
        print(f"[gpu_check] {name} (budget {budget:.0f} s)", file=sys.stderr, flush=True)
        try:
            value = await asyncio.wait_for(phase(), budget)
        except TimeoutError:
            result.status, result.detail = "timed out", f"after {budget:.0f} s; its partial results are kept"
            value = None
        except Exception as exc:  # a failed phase is reported; the others still run
            result.status, result.detail = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            value = None
        else:
            result.status = "ok"
        result.seconds = round(time.monotonic() - started, 2)
        print(
            f"[gpu_check] {name}: {result.status} in {result.seconds:.0f} s {result.detail}",
            file=sys.stderr,
            flush=True,
        )
        return value


# ---- requests -----------------------------------------------------------------------------------------


def prompt_ids(seed: str, length: int, vocab: int) -> list[int]:
    """Token ids every vocabulary here has (bytes and early merges), random per seed: prompts of different
    seeds share no prefix, so the engines' prefix caches never shorten a measured prefill."""
    draw = random.Random(seed)
    return [draw.randrange(10, min(vocab, 400)) for _ in range(length)]


def completion(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def generate(node: Node, request_id: str, body: dict[str, Any]) -> Any:
    return node.api.Generate(
        pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION, body_json=json.dumps(body))
    )


async def reference_tokens(node: Node, request_id: str, prompt: list[int], count: int) -> list[int]:
    """The greedy tokens of `prompt` without a move."""
    tokens: list[int] = []
    async for message in generate(node, request_id, completion(prompt, count)):
        tokens += message.chunk.token_ids
    return tokens


async def migrated_tokens(
    source: Node, destination: Node, request_id: str, prompt: list[int], plan: Plan
) -> tuple[mpb.MigrateOutResponse, list[int]]:
    """Starts the request on `source`, moves it after `plan.decode_before` tokens, follows it to
    `destination` and returns the move's outcome and the first `plan.compared` tokens."""
    tokens: list[int] = []
    result: mpb.MigrateOutResponse | None = None
    # As many tokens as the context allows: still decoding when the move ends, however long the copy takes
    # on a slow machine; aborted once the compared tokens have arrived.
    call = generate(source, request_id, completion(prompt, plan.max_model_len - len(prompt) - 1))
    async for message in call:
        if message.HasField("moved"):
            break
        tokens += message.chunk.token_ids
        if result is None and len(tokens) >= plan.decode_before:
            result = await source.migration.MigrateOut(
                mpb.MigrateOutRequest(
                    destination_instance_id=destination.pair.config.instance_id,
                    destination_address=destination.pair.grpc_address,
                    request_id=request_id,
                )
            )
            if result.outcome != mpb.MIGRATION_OUTCOME_COMMITTED:
                await source.api.Abort(pb.AbortRequest(request_id=request_id))
                call.cancel()
                return result, tokens
    assert result is not None
    here = destination.api.Generate(pb.GenerateRequest(request_id=request_id, attach=True))
    async for message in here:
        tokens += message.chunk.token_ids
        if len(tokens) >= plan.compared:
            break
    await destination.api.Abort(pb.AbortRequest(request_id=request_id))
    here.cancel()
    return result, tokens[: plan.compared]


async def stream_times(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """Arrival time of every streamed token of one request sent straight to an engine."""
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:500]}")
        async for line in response.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                times.append(time.perf_counter())
    return times


async def time_to_first_token_ms(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    times = await stream_times(session, url, completion(prompt, 1))
    if not times:
        raise RuntimeError(f"{url} streamed no token")
    return (times[0] - started) * 1e3


# ---- phase 3: migration -------------------------------------------------------------------------------


def channels(gpus: int, device: str) -> tuple[list[str], dict[str, str]]:
    """The KV channels to measure and the ones skipped, with the reason."""
    skipped = {}
    if device == "cpu":
        skipped["nccl"] = "CPU engines (NCCL needs CUDA)"
    elif gpus < 2:
        skipped["nccl"] = (
            "one GPU: NCCL cannot hold two ranks of one communicator on one device; run "
            "bench/migration_gpu.py --gpus 0,1 on a machine with two"
        )
    else:
        skipped["nccl"] = (
            "both engines share GPU 0 here; NCCL between two GPUs is bench/migration_gpu.py --gpus 0,1"
        )
    return ["tcp", "gloo"], skipped


async def measure_migrations(
    a: Node, b: Node, plan: Plan, vocab: int, rows: list[dict[str, Any]], transports: list[str]
) -> None:
    """Both llumlets start with the first transport; they are restarted with each next one."""
    async with aiohttp.ClientSession() as session:
        for index, transport in enumerate(transports):
            if index:
                await asyncio.gather(
                    a.restart_llumlet("--migration-transport", transport),
                    b.restart_llumlet("--migration-transport", transport),
                )
            # Not measured: the first migration and prefill of an engine pay one-off initialisation.
            await migrated_tokens(
                a, b, f"warmup-{transport}", prompt_ids(f"warm-up {transport}", plan.lengths[0], vocab), plan
            )
            for length in plan.lengths:
                prompt = prompt_ids(f"migrate {transport} {length}", length - plan.decode_before, vocab)
                reference = await reference_tokens(a, f"ref-{transport}-{length}", prompt, plan.compared)
                result, moved = await migrated_tokens(a, b, f"mig-{transport}-{length}", prompt, plan)
                recompute_ms = await time_to_first_token_ms(
                    session, b.pair.engine_url, prompt_ids(f"recompute {transport} {length}", length, vocab)
                )
                first_difference = next(
                    (i for i, (x, y) in enumerate(zip(moved, reference, strict=False)) if x != y), None
                )
                rows.append(
                    {
                        "transport": result.transport or transport,
                        "tokens": length,
                        "outcome": mpb.MigrationOutcome.Name(result.outcome).removeprefix(
                            "MIGRATION_OUTCOME_"
                        ),
                        "reason": result.reason,
                        "downtime_ms": round(result.downtime_ms, 2),
                        "duration_ms": round(result.duration_ms, 2),
                        "stages": result.stages,
                        "bytes": result.bytes,
                        "migrated_tokens": result.migrated_tokens,
                        "recompute_ms": round(recompute_ms, 2),
                        "equal": moved == reference,
                        "compared_tokens": len(reference),
                        "first_difference": first_difference,
                        "distinct_tokens": len(set(reference)),
                    }
                )


# ---- phase 4: router against direct -------------------------------------------------------------------


async def closed_loop(urls: list[str], plan: Plan, vocab: int, path: str) -> dict[str, float]:
    """`plan.router_concurrency` clients sending `plan.router_requests` requests round-robin over `urls`."""
    queue = list(range(plan.router_requests))
    ttft: list[float] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while queue:
            index = queue.pop()
            body = completion(prompt_ids(f"{path} {index}", plan.router_prompt, vocab), plan.router_output)
            started = time.perf_counter()
            times = await stream_times(session, urls[index % len(urls)], body)
            if times:
                ttft.append((times[0] - started) * 1e3)

    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=plan.router_concurrency)
    ) as s:
        await asyncio.gather(*(client(s) for _ in range(plan.router_concurrency)))
    seconds = time.perf_counter() - started
    # ignore_eos: every completed request generated exactly router_output tokens
    return {
        "output_tokens_per_s": round(len(ttft) * plan.router_output / seconds, 1),
        "median_ttft_ms": round(statistics.median(ttft), 2),
        "requests": len(ttft),
        "seconds": round(seconds, 2),
    }


async def measure_router(a: Node, b: Node, plan: Plan, vocab: int, work: Path, into: dict[str, Any]) -> None:
    port = free_port()
    router: ChildProcess = await start_service(
        "llumnix router",
        [
            sys.executable,
            "-m",
            "llumnix.cli",
            "router",
            "--model",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--instances",
            f"{a.pair.grpc_address},{b.pair.grpc_address}",
            "--log-level",
            "warning",
        ],
        port,
        work,
    )
    try:
        # Prompts of their own per path: neither finds the other's in a prefix cache.
        into["direct"] = await closed_loop([a.pair.engine_url, b.pair.engine_url], plan, vocab, "direct")
        into["router"] = await closed_loop([f"http://127.0.0.1:{port}"], plan, vocab, "router")
        into["router_to_direct"] = round(
            into["router"]["output_tokens_per_s"] / into["direct"]["output_tokens_per_s"], 3
        )
    finally:
        await router.terminate(10)


# ---- phase 5: latency profile -------------------------------------------------------------------------


async def batch_streams(
    session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], steps: int
) -> list[list[float]]:
    """Token arrival times of concurrent streams, each read until it has `steps` tokens after the moment
    every stream had its first one, then closed (which aborts its request): a window in which the whole
    batch decodes, however slowly the requests were admitted."""
    begun = 0
    together = asyncio.Event()

    async def one(body: dict[str, Any]) -> list[float]:
        nonlocal begun
        times: list[float] = []
        since = 0
        async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
            if response.status != 200:
                raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:500]}")
            async for line in response.content:
                if not (line.startswith(b"data: ") and b'"text"' in line):
                    continue
                times.append(time.perf_counter())
                if len(times) == 1:
                    begun += 1
                    if begun == len(bodies):
                        together.set()
                since += together.is_set()
                if since > steps:
                    break
        return times

    return list(await asyncio.gather(*(one(body) for body in bodies)))


def decode_step_s(streams: list[list[float]]) -> float:
    """Mean step time while every stream of a batch decodes: from the last stream's first token to the first
    stream's last, divided by the steps one stream took in between (the median stream)."""
    start = max(s[0] for s in streams)
    end = min(s[-1] for s in streams)
    steps = [sum(1 for t in s if start <= t <= end) - 1 for s in streams]
    per_stream = [(end - start) / n for n in steps if n > 0]
    if not per_stream:
        raise RuntimeError("no stream decoded while the whole batch was running")
    return statistics.median(per_stream)


def decode_cell(batch: int, total: int, plan: Plan) -> tuple[int, bool]:
    """Prompt tokens per sequence for a grid cell, and whether the cell is the nearest one that fits
    (contexts of at least 16 tokens, at most what max-model-len leaves for the decode steps)."""
    longest = plan.max_model_len - plan.decode_steps - 8
    per_sequence = total // batch
    fitted = min(max(per_sequence, 16), longest)
    return fitted, fitted != per_sequence


async def measure_profile(node: Node, plan: Plan, vocab: int, into: dict[str, Any]) -> None:
    url = node.pair.engine_url
    into.setdefault("prefill", [])
    into.setdefault("decode", [])
    # No connection limit: a batch is that many concurrent streams.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await time_to_first_token_ms(session, url, prompt_ids("profile warm-up", 16, vocab))  # warm-up
        for tokens in plan.prefill_tokens:
            ms = [
                await time_to_first_token_ms(session, url, prompt_ids(f"prefill {tokens} {i}", tokens, vocab))
                for i in range(PREFILL_REPEATS)
            ]
            into["prefill"].append({"tokens": tokens, "seconds": round(statistics.median(ms) / 1e3, 5)})
        for batch in plan.batch_sizes:
            for total in plan.context_totals:
                per_sequence, fitted = decode_cell(batch, total, plan)
                # As long as the context allows: none ends before the whole batch decodes together.
                bodies = [
                    completion(
                        prompt_ids(f"decode {batch} {total} {i}", per_sequence, vocab),
                        plan.max_model_len - per_sequence - 1,
                    )
                    for i in range(batch)
                ]
                streams = await batch_streams(session, url, bodies, plan.decode_steps)
                into["decode"].append(
                    {
                        "batch_size": batch,
                        "context_tokens": total,
                        "prompt_tokens_per_sequence": per_sequence,
                        "fitted": fitted,
                        "seconds": round(decode_step_s(streams), 6),
                    }
                )


def latency_profile(
    measured: dict[str, Any], plan: Plan, engine: dict[str, Any], migrations: list[dict[str, Any]]
) -> dict[str, Any]:
    """The measured profile (docs/latency-profile.md) from the profile phase and the engine's geometry;
    the migration bandwidth is the fastest committed migration's bytes per second."""
    grid = {(d["batch_size"], d["context_tokens"]): d["seconds"] for d in measured["decode"]}
    committed = [m for m in migrations if m["outcome"] == "COMMITTED" and m["duration_ms"] > 0]
    bandwidth = max((m["bytes"] / (m["duration_ms"] / 1e3) for m in committed), default=0.0)
    smallest = min(committed, key=lambda m: m["bytes"], default=None)
    profile = {
        "kind": "measured",
        "name": f"gpu-check-{engine['model']}-{engine['device_name']}".lower().replace(" ", "-"),
        "description": f"Measured by bench/gpu_check.py on {engine['device_name']}: {engine['model']}, "
        f"vLLM {engine['vllm']}, {engine['mode']}; through the engine's API (HTTP and "
        "tokenisation included).",
        "prefill": {
            "tokens": [p["tokens"] for p in measured["prefill"]],
            "seconds": [p["seconds"] for p in measured["prefill"]],
        },
        "decode": {
            "batch_sizes": list(plan.batch_sizes),
            "context_tokens": list(plan.context_totals),
            "seconds": [[grid[(b, c)] for c in plan.context_totals] for b in plan.batch_sizes],
        },
        "engine": {
            "block_size": engine["block_size"],
            "kv_capacity_tokens": engine["kv_capacity_tokens"],
            "kv_bytes_per_token": engine["kv_bytes_per_token"],
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "migration_bandwidth": round(bandwidth or 1e9, 1),
            "kv_transfer_latency_s": round(smallest["downtime_ms"] / 1e3, 5) if smallest else 0.001,
        },
    }
    profile_from_dict(profile, "the measured profile")  # the simulator must load what is written
    return profile


# ---- the run ------------------------------------------------------------------------------------------


def engine_config(plan: Plan, model_dir: Path) -> EngineLaunchConfig:
    gpu = plan.device == "gpu"
    return EngineLaunchConfig(
        model=model_dir,
        port=0,
        served_model_name=MODEL,
        device="gpu" if gpu else "cpu",
        gpu_memory_utilization=0.4,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.max_num_seqs,
        # eager: CUDA graph capture would take most of the engines' start-up budget
        extra_args=(
            "--max-num-batched-tokens",
            str(plan.max_num_batched_tokens),
            *(("--enforce-eager",) if gpu else ()),
        ),
    )


def engine_facts(plan: Plan, pair: EnginePair, vocab: int) -> dict[str, Any]:
    from llumnix.engine.handshake import read_handshake

    handshake = read_handshake(Path(pair.config.work_dir / "snapshots.sock.handshake.json"))
    recipe = plan.recipe
    dtype_bytes = 4 if recipe.dtype == "float32" else 2
    return {
        "block_size": handshake["block_size"],
        "kv_capacity_tokens": int(handshake["num_blocks"]) * int(handshake["block_size"]),
        "kv_bytes_per_token": 2 * recipe.layers * recipe.kv_heads * recipe.head_dim * dtype_bytes,
        "kv_dtype": handshake["kv_dtype"],
        "kv_channels": handshake.get("kv_channels"),
        "vocab_size": vocab,
    }


def environment(plan: Plan) -> dict[str, Any]:
    """The machine and its vLLM; exits at once, saying why, where no supported vLLM is installed."""
    import torch

    try:
        import vllm
    except ImportError:
        raise SystemExit(
            "gpu_check: vLLM is not installed (pip install -e '.[gpu]', or '.[cpu]' for --cpu); "
            "bench/kv_channel_gpu.py measures the KV channel on a GPU without it"
        ) from None
    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVllmError as exc:
        raise SystemExit(f"gpu_check: {exc}") from None
    gpus = torch.cuda.device_count() if plan.device == "gpu" else 0
    return {
        "mode": "GPU" if plan.device == "gpu" else "CPU dry run (tiny model)",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpus": gpus,
        "device_name": torch.cuda.get_device_name(0) if gpus else "cpu",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpus else 0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = CPU_PLAN if args.cpu else GPU_PLAN
    budgets = {**plan.budgets, **({"total": args.budget} if args.budget else {})}
    phases = Phases(budgets["total"])
    report: dict[str, Any] = {
        "plan": {k: v for k, v in dataclasses.asdict(plan).items() if k != "budgets"},
        "budgets_s": budgets,
        "environment": environment(plan),
        "migrations": [],
        "router": {},
        "profile_measurements": {},
    }
    env = report["environment"]
    if plan.device == "gpu" and not env["gpus"]:
        raise SystemExit("gpu_check: no CUDA GPU is visible (use --cpu for the dry run)")
    report["environment"]["model"] = "llama-7b-shape" if plan.recipe is LLAMA_7B else "tiny"
    transports, skipped = channels(env["gpus"], plan.device)
    report["skipped_channels"] = skipped
    device = "cuda" if plan.device == "gpu" else "cpu"
    built = await phases.run(
        "model",
        budgets["model"],
        lambda: asyncio.to_thread(ensure_random_llama, args.model_cache, plan.recipe, device),
    )
    pairs: list[EnginePair] = []
    nodes: list[Node] = []
    router_work = args.out / "logs"
    try:
        if built is not None:
            model_dir, record = built
            report["model"] = record
            vocab = int(record["vocab_size"])

            async def start_engines() -> None:
                for name in ("a", "b"):  # one at a time: vLLM profiles memory on the shared device
                    pair = EnginePair(
                        PairConfig(
                            instance_id=name,
                            work_dir=args.out / "logs" / name,
                            served_model_name=MODEL,
                            vllm=engine_config(plan, model_dir),
                            llumlet_args=("--migration-transport", transports[0]),
                            shutdown_grace_s=5.0,
                            engine_start_timeout_s=budgets["engines"],
                        )
                    )
                    pairs.append(pair)
                    await pair.start()
                    nodes.append(Node(pair))

            await phases.run("engines", budgets["engines"], start_engines)
        else:
            phases.skip("engines", budgets["engines"], "no model")
        if phases.ok("engines"):
            a, b = nodes
            report["engine"] = {**env, **engine_facts(plan, a.pair, vocab)}
            await phases.run(
                "migration",
                budgets["migration"],
                lambda: measure_migrations(a, b, plan, vocab, report["migrations"], transports),
            )
            await phases.run(
                "router",
                budgets["router"],
                lambda: measure_router(a, b, plan, vocab, router_work, report["router"]),
            )
            await phases.run(
                "profile",
                budgets["profile"],
                lambda: measure_profile(a, plan, vocab, report["profile_measurements"]),
            )
        else:
            for name in ("migration", "router", "profile"):
                phases.skip(name, budgets[name], "the engines did not start")
    finally:
        for node in nodes:
            await node.channel.close()
        await asyncio.gather(*(p.stop() for p in pairs), return_exceptions=True)
    report["phases"] = [dataclasses.asdict(r) for r in phases.results]
    if phases.ok("profile"):
        try:
            report["profile"] = latency_profile(
                report["profile_measurements"], plan, report["engine"], report["migrations"]
            )
        except (KeyError, ValueError) as exc:
            report["profile_error"] = str(exc)
    return report


# ---- the report ---------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    env, plan = report["environment"], report["plan"]
    lines = [
        f"# GPU check: {env['mode']}",
        "",
        f"{env['device_name']} ({env['gpus']} GPU(s), {env['gpu_memory_gib']} GiB), vLLM {env['vllm']}, "
        f"torch {env['torch']}; model {env['model']} ({plan['recipe']['layers']} layers, hidden "
        f"{plan['recipe']['hidden']}, {plan['recipe']['dtype']}, random weights).",
        "",
        "| phase | status | seconds | budget s | detail |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['name']} | {p['status']} | {p['seconds']} | {p['budget_s']} | {p['detail']} |"
        for p in report["phases"]
    ]
    if "model" in report:
        m = report["model"]
        lines += [
            "",
            f"Model: {m['parameters']:,} parameters, {m['bytes'] / 2**30:.1f} GiB in {m['shards']} "
            f"safetensors shard(s), written in {m['seconds']} s" + (" (reused)" if m.get("reused") else ""),
        ]
    if "engine" in report:
        e = report["engine"]
        lines += [
            "",
            f"Engines: two sharing the device, {e['kv_capacity_tokens']:,} KV tokens each in blocks "
            f"of {e['block_size']} ({e['kv_dtype']}, {e['kv_bytes_per_token']:,} bytes per token); "
            f"channels {', '.join(e['kv_channels'] or [])}.",
        ]
    lines += [
        "",
        "## Live migration against recompute",
        "",
        "| channel | tokens | outcome | downtime ms | duration ms | stages | MiB | recompute ms | "
        "tokens equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["migrations"]:
        equal = "yes" if r["equal"] else f"no (first difference at {r['first_difference']})"
        outcome = f"{r['outcome']} ({r['reason']})" if r["reason"] else r["outcome"]
        lines.append(
            f"| {r['transport']} | {r['tokens']} | {outcome} | {r['downtime_ms']} | "
            f"{r['duration_ms']} | {r['stages']} | {r['bytes'] / 2**20:.1f} | {r['recompute_ms']} | "
            f"{equal}, {r['compared_tokens']} compared, {r['distinct_tokens']} distinct |"
        )
    lines += [f"- {channel}: skipped: {why}" for channel, why in report["skipped_channels"].items()]
    router = report["router"]
    if "router" in router:
        lines += [
            "",
            "## Router against direct",
            "",
            "| path | output tok/s | median TTFT ms | requests |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {router[name]['output_tokens_per_s']} | {router[name]['median_ttft_ms']} | "
            f"{router[name]['requests']} |"
            for name in ("direct", "router")
        ]
        lines += ["", f"Router / direct: {router['router_to_direct']}"]
    if "profile" in report:
        profile = report["profile"]
        lines += [
            "",
            "## Latency profile (loaded by `llumnix simulate --profile gpu_check_profile.json`)",
            "",
            "| prefill tokens | seconds |",
            "|---|---|",
        ]
        lines += [
            f"| {t} | {s} |"
            for t, s in zip(profile["prefill"]["tokens"], profile["prefill"]["seconds"], strict=True)
        ]
        decode = profile["decode"]
        lines += [
            "",
            "| decode batch \\ context tokens | " + " | ".join(map(str, decode["context_tokens"])) + " |",
            "|---|" + "---|" * len(decode["context_tokens"]),
        ]
        lines += [
            f"| {b} | " + " | ".join(f"{s * 1e3:.2f} ms" for s in row) + " |"
            for b, row in zip(decode["batch_sizes"], decode["seconds"], strict=True)
        ]
        fitted = [d for d in report["profile_measurements"]["decode"] if d["fitted"]]
        if fitted:
            lines += [
                "",
                "Cells measured at the nearest context that fits (16 to max-model-len tokens per "
                "sequence): " + ", ".join(f"{d['batch_size']}x{d['context_tokens']}" for d in fitted),
            ]
    elif "profile_error" in report:
        lines += ["", f"Profile not written: {report['profile_error']}"]
    return "\n".join(lines) + "\n"


def write_reports(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    if "profile" in report:
        (out / "gpu_check_profile.json").write_text(json.dumps(report["profile"], indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: CPU vLLM, the tiny model, small sizes")
    parser.add_argument("--out", type=Path, default=None, help="reports and logs (default: a new temp dir)")
    parser.add_argument(
        "--model-cache",
        type=Path,
        default=REPO / ".cache" / "models",
        help="where the random model is written, or found (default: %(default)s)",
    )
    parser.add_argument(
        "--budget", type=float, default=0.0, help="overall seconds (default: 480 on GPU, 1500 with --cpu)"
    )
    args = parser.parse_args()
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))).resolve()
    report = asyncio.run(run(args))
    write_reports(report, args.out)
    print(markdown(report))
    print(f"reports in {args.out}", file=sys.stderr)
    return 0 if all(p["status"] == "ok" for p in report["phases"]) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.aio.AioRpcError as exc:  # a llumlet went away outside a phase
        sys.exit(f"gpu_check: {exc.code().name}: {exc.details()}")
