"""One real CPU vLLM engine with the llumnix connector: snapshots against the engine's own metrics and
real requests, and a request's KV blocks sent as a final migration stage (ExportFinal) to a KV receiver.

The engine admits at most two running requests, so that requests also queue.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from waiting import wait_until

from llumnix.engine.engine_channel import EngineCommandClient, control_address
from llumnix.engine.handshake import read_handshake
from llumnix.engine.snapshots import SnapshotSubscriber
from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess
from llumnix.launch.pair import free_port
from llumnix.v1.engine_pb2 import EngineSnapshot

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]

BLOCK_SIZE = 32
MAX_NUM_SEQS = 2
MAX_MODEL_LEN = 4096  # long_context_tiny_model_dir's positions
LONG = 3000
WATERMARK = 0.01
"""vLLM's `--watermark` (0 by default): the share of blocks it keeps free when admitting a request."""
"""Tokens of a request that must outlive what a test does while it runs, however fast the engine
decodes or slowly the machine lets the test look (440 ended first under a CPU hog)."""


@dataclass
class Engine:
    process: EngineProcess
    subscriber: SnapshotSubscriber
    session: aiohttp.ClientSession
    handshake_path: Path
    commands: EngineCommandClient

    async def complete(self, llumlet_id: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "kv_transfer_params": {"llumlet_id": llumlet_id, **extra}}
        if extra:
            body["return_token_ids"] = True
        async with self.session.post(f"{self.process.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    async def snapshot(self, predicate: Callable[[EngineSnapshot], bool] = lambda s: True,
                       after: float = 0.0, timeout_s: float = 20.0) -> EngineSnapshot:
        """The first snapshot taken after `after` that satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snapshot = await self.subscriber.receive(0.5)
            if snapshot is not None and snapshot.timestamp >= after and predicate(snapshot):
                return snapshot
        raise AssertionError("no matching snapshot within the timeout")

    async def metrics(self) -> tuple[float, int]:
        """vLLM's own view: (kv_cache_usage_perc, num_gpu_blocks)."""
        async with self.session.get(f"{self.process.url}/metrics") as response:
            text = await response.text()
        usage = float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M).group(1))
        blocks = int(re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M).group(1))
        return usage, blocks


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(
    long_context_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Engine]:
    work = tmp_path_factory.mktemp("engine")
    addr = f"ipc://{work}/engine.sock"
    process = EngineProcess(EngineLaunchConfig(
        model=long_context_tiny_model_dir, port=free_port(), served_model_name="tiny", dtype="float32",
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, snapshot_addr=addr,
        engine_id="engine-0", log_path=work / "engine.log", extra_args=("--watermark", str(WATERMARK)),
    ))
    # ~20-40 s on an idle 2-core machine; generous for a loaded one.
    await process.start(timeout_s=420)
    subscriber = SnapshotSubscriber(addr)
    # A connection per request: a pooled one that the server's keep-alive timer (5 s) closes just as a
    # test reuses it, after a pause such as importing transformers, fails the request.
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                    connector=aiohttp.TCPConnector(force_close=True))
    commands = EngineCommandClient(control_address(addr))
    try:
        yield Engine(process, subscriber, session, work / "engine.sock.handshake.json", commands)
    finally:
        commands.close()
        await session.close()
        subscriber.close()
        await process.stop()


def prompt_of(words: int) -> str:
    return " ".join(["llumnix moves requests"] * words)


async def test_idle_snapshot_matches_vllm_block_count(engine: Engine):
    snapshot = await engine.snapshot(lambda s: not s.running and not s.waiting)
    usage, num_gpu_blocks = await engine.metrics()
    assert snapshot.engine_id == "engine-0" and snapshot.block_size == BLOCK_SIZE
    # vLLM keeps one block back (the null block) and leaves it out of its usage metric too; the
    # watermark it keeps free when admitting is no room for a new request either.
    watermark = int(WATERMARK * num_gpu_blocks)
    assert watermark >= 2
    assert abs(snapshot.total_blocks - (num_gpu_blocks - 1 - watermark)) <= 1
    assert snapshot.free_blocks == snapshot.total_blocks and usage == 0.0


async def test_a_snapshot_per_engine_step_with_the_request_tokens(engine: Engine):
    started = time.time()
    request = asyncio.create_task(engine.complete("steps", prompt_of(20), max_tokens=64))
    seen: list[EngineSnapshot] = []
    while not request.done():
        snapshot = await engine.subscriber.receive(0.5)
        if snapshot is not None and snapshot.timestamp >= started and any(
                r.request_id == "steps" for r in snapshot.running):
            seen.append(snapshot)
    result = await request
    prompt_tokens = result["usage"]["prompt_tokens"]
    assert len(seen) >= 5
    rows = [next(r for r in s.running if r.request_id == "steps") for s in seen]
    for snapshot, row in zip(seen, rows, strict=True):
        assert row.prompt_tokens == prompt_tokens
        assert row.engine_request_id != "steps"  # vLLM's rewritten id is reported beside ours
        # KV valid after this step: the prompt plus every sampled token but the newest.
        assert row.computed_tokens == row.prompt_tokens + row.output_tokens
        assert row.blocks == math.ceil(row.computed_tokens / BLOCK_SIZE)
        assert snapshot.total_blocks - snapshot.free_blocks >= row.blocks
    steps = [s.step for s in seen]
    assert steps == sorted(set(steps))
    # `step` counts publications: the pump keeps only the newest state, so on a busy machine one
    # publication may cover several decode steps. Tokens only move forward as the counter does.
    tokens = [row.output_tokens for row in rows]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]
    done = await engine.snapshot(lambda s: not s.running, after=time.time())
    assert done.free_blocks == done.total_blocks


async def test_free_blocks_track_vllm_usage_within_one_block(engine: Engine):
    async def used_blocks(request_id: str) -> int | None:
        """Blocks in use in the next snapshot, or None once the request no longer runs (a fast engine
        may finish it between two reads; the engine publishes idle snapshots too)."""
        snapshot = await engine.snapshot(after=time.time())
        if not any(r.request_id == request_id for r in snapshot.running):
            return None
        return snapshot.total_blocks - snapshot.free_blocks

    comparisons = 0
    gauge_moved = False
    # One request at a time, each LONG; one that ends before enough comparisons (a fast engine, or
    # slow scrapes on a loaded machine) is followed by another.
    for attempt in range(8):
        request_id = f"usage-{attempt}"
        request = asyncio.create_task(engine.complete(request_id, prompt_of(10), max_tokens=LONG))
        while comparisons < 5:
            # vLLM updates its gauge once per step too; compare only when the snapshots on both sides
            # of the scrape agree, so a block allocated between the two reads does not count as a
            # mismatch.
            read_before = await used_blocks(request_id)
            usage, num_gpu_blocks = await engine.metrics()
            read_after = await used_blocks(request_id)
            if read_before is None or read_after is None:
                break
            before, after = read_before, read_after
            gauge_moved = gauge_moved or usage > 0
            if before == after and gauge_moved:
                # vLLM's usage is of every block but the null one, the watermark's included.
                assert abs(round(usage * (num_gpu_blocks - 1)) - after) <= 1, (usage, num_gpu_blocks, after)
                comparisons += 1
        await request
        if comparisons >= 5:
            break
    # vLLM sets the gauge every step from its scheduler's block pool (SchedulerStats.kv_cache_usage,
    # CPU build included): 0.0 throughout while the engine held blocks is a broken metric, not a skip.
    assert gauge_moved, "vllm:kv_cache_usage_perc stayed 0.0 while the engine held KV blocks"
    assert comparisons >= 5, f"{comparisons} comparisons in 8 requests"


async def test_queued_requests_show_as_waiting_then_run(engine: Engine):
    prompts = {f"q{i}": prompt_of(10 + 5 * i) for i in range(4)}
    started = time.time()
    requests = {
        # The first two still run when the last arrives, however slowly a loaded machine admits them.
        rid: asyncio.create_task(engine.complete(rid, p, max_tokens=LONG // 3)) for rid, p in prompts.items()
    }
    crowded = await engine.snapshot(lambda s: len(s.running) == MAX_NUM_SEQS and len(s.waiting) >= 1,
                                    after=started)
    for waiting in crowded.waiting:
        assert waiting.blocks == 0 and waiting.computed_tokens == 0 and waiting.prompt_tokens > 0
    arrivals = [w.arrival_time for w in crowded.waiting]
    assert arrivals == sorted(arrivals)
    results = {rid: await task for rid, task in requests.items()}
    idle = await engine.snapshot(lambda s: not s.running and not s.waiting, after=time.time())
    assert idle.free_blocks == idle.total_blocks
    # Every request was seen with the prompt length the engine reported.
    reported = {r.request_id: r.prompt_tokens for r in [*crowded.running, *crowded.waiting]
                if r.request_id in prompts}
    assert reported
    for rid, prompt_tokens in reported.items():
        assert prompt_tokens == results[rid]["usage"]["prompt_tokens"]


async def test_handshake_record_describes_the_kv_cache(engine: Engine):
    record = read_handshake(engine.handshake_path)
    assert record["engine_id"] == "engine-0" and record["block_size"] == BLOCK_SIZE
    assert record["kv_dtype"] == "float32" and record["tensor_parallel_size"] == 1
    layout = record["kv_layout"]
    # Tiny model: 2 layers, 2 KV heads of 32; CPU pages hold K and V side by side.
    assert len(layout["layer_names"]) == 2 and layout["page_shape"] == [2, BLOCK_SIZE, 64]
    assert record["num_blocks"] >= (await engine.snapshot()).total_blocks


async def test_final_stage_holds_the_requests_kv_and_round_trips(engine: Engine,
                                                                  long_context_tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from llumnix.engine.handshake import migration_key
    from llumnix.engine.kv_blocks import KVBlockCopier
    from llumnix.engine.kv_staging import StagingStore
    from llumnix.engine.kv_transport_tcp import TcpKVReceiver
    from llumnix.v1.kv_transfer_pb2 import EngineCommand, ExportFinal

    record = read_handshake(engine.handshake_path)
    layout = record["kv_layout"]
    staging = StagingStore(int(layout["bytes_per_block"]), str(record["kv_dtype"]))
    finals: list[int] = []
    receiver = TcpKVReceiver("127.0.0.1", 0, staging=staging,
                             on_stage=lambda header: header.final and finals.append(header.num_tokens))
    receiver.start()
    try:
        # Long enough that a client behind a loaded engine still registers the export while the request
        # runs (40, then 360 tokens ended first under a CPU hog: "unknown request").
        body = {"model": "tiny", "prompt": prompt_of(15), "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "kv_transfer_params": {"llumlet_id": "export-me"}}
        token_ids: list[int] = []
        async with engine.session.post(f"{engine.process.url}/v1/completions", json=body) as response:
            async for line in response.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                choice = json.loads(text[6:])["choices"][0]
                if not token_ids:
                    # Registered while the request runs; it takes effect when the request finishes.
                    final = ExportFinal(migration_id="export-me", request_id="export-me",
                                        kv_address=receiver.address,
                                        kv_key=migration_key(receiver.kv_secret, "export-me"))
                    reply = await engine.commands.send(EngineCommand(schema_version=1, export_final=final))
                    assert reply.ok, reply.error
                    token_ids += choice.get("prompt_token_ids") or []
                token_ids += choice.get("token_ids") or []
        await wait_until(lambda: finals, "the final stage", timeout_s=20)
    finally:
        receiver.close()
    staged = staging.take("export-me")
    num_tokens = staged.num_tokens
    assert num_tokens == finals[0] == len(token_ids) - 1  # the newest sampled token has no KV yet
    blocks = math.ceil(num_tokens / BLOCK_SIZE)
    raw = torch.cat([torch.frombuffer(part, dtype=torch.uint8) for part in staged.parts(0, blocks)])
    # Block-major on the wire: [blocks, layers, kernel blocks per block (1 here), kv_heads, block_tokens,
    # content].
    buffer = raw.view(torch.float32).reshape(blocks, 2, 1, 2, BLOCK_SIZE, 64)

    # The engine's K and V equal a reference forward pass over the same tokens.
    model = AutoModelForCausalLM.from_pretrained(long_context_tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([token_ids[:num_tokens]]), use_cache=True).past_key_values
    for layer in range(2):
        # CPU page of one head: K transposed [head_dim, block_tokens], then V [block_tokens, head_dim].
        pages = buffer[:, layer, 0].reshape(blocks, 2, 2, 32 * BLOCK_SIZE)
        keys = pages[:, :, 0].reshape(blocks, 2, 32, BLOCK_SIZE).permute(1, 0, 3, 2).reshape(2, -1, 32)
        values = pages[:, :, 1].reshape(blocks, 2, BLOCK_SIZE, 32).permute(1, 0, 2, 3).reshape(2, -1, 32)
        reference = cache.layers[layer]
        torch.testing.assert_close(keys[:, :num_tokens], reference.keys[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[:, :num_tokens], reference.values[0], rtol=1e-4, atol=1e-4)

    # Copy in (other block ids of a cache with the engine's layout) and out again: unchanged.
    cache_blocks = blocks + 8
    caches = {name: torch.zeros((cache_blocks, 2, BLOCK_SIZE, 64)) for name in layout["layer_names"]}
    copier = KVBlockCopier(caches, num_blocks=cache_blocks)
    targets = list(range(cache_blocks - 1, cache_blocks - 1 - blocks, -1))
    copier.copy_in_block_major(targets, buffer)
    assert torch.equal(copier.copy_out_block_major(targets), buffer)
    # The engine freed the blocks once the final stage was copied out.
    idle = await engine.snapshot(lambda s: not s.running, after=time.time())
    assert idle.free_blocks == idle.total_blocks
