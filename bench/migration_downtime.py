"""Live migration downtime against its baselines, on two CPU vLLM engines with llumlets.

For each sequence length (tokens held by the request when it moves) it measures, through the
llumlet's MigrateOut:
- live migration (stages while decoding, then a small final stage): downtime (final-stage abort ->
  the destination's first token), total time, stages;
- blocking copy (the source llumlet restarted with --migration-max-stages 0: everything is copied
  in the final stage, while the request is stopped);
- recompute: the destination prefilling prompt + generated tokens without KV (a fresh prompt,
  prefix caching off), i.e. the downtime of migrating by resubmission;
and the decode-step slowdown of another request on the source while the migration runs, and the moved
request's decode step at the destination afterwards (the normal inter-token time at that length: its
first step there is part of the downtime). One unmeasured migration and prefill first warm the engines
up (their first migrated-in request and first prefill pay one-off initialisation).

A migration that does not commit is reported with its outcome and counted, never aborts the run.
`--soak N` then moves requests of about SOAK_PROMPT tokens back and forth N times in a row while another
request decodes on each engine, and prints the outcomes, the downtime's and duration's median, P99
and maximum, the same for each of the downtime's parts (with the parts of the longest downtimes), and
the background requests' own gaps between tokens over the same seconds
(docs/figures/migration_soak_<model>.md; `--no-soak-background` runs it without those requests).

Writes a Markdown table and JSON next to a PNG (docs/figures/migration_downtime_<model>.png), and
prints the model's compute per KV byte beside LLaMA-7B's (~14 GFLOP prefill per token vs 512 KiB of
fp16 KV per token): migration beats recompute by that ratio's margin on real models.

    .venv/bin/python bench/migration_downtime.py --model tiny --lengths 256,1024,2048
    .venv/bin/python bench/migration_downtime.py --model tiny --soak 100
    .venv/bin/python bench/migration_downtime.py --model 7b-like
    .venv/bin/python bench/migration_downtime.py --model tiny --transport gloo --out /tmp/gloo
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from bench_service import run_cleanly
from bench_stats import percentile
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from llumlet.migration.downtime import downtime_parts
from llumnix.launch.llumlet_process import LlumletProcess
from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.tiny_model import PRESETS, TinyModelRecipe, ensure_tiny_model
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

REPO = Path(__file__).resolve().parent.parent
MODELS = {"tiny": "test", "7b-like": "7b-like"}
DECODE_BEFORE_MOVE = 16
DECODE_AFTER_MOVE = 64
"""Enough tokens at the destination that most arrive one step apart after the caller attached."""
HEADROOM = 512
"""More tokens than a measured request reads: it is still decoding when its migration starts and ends,
whatever the machine's speed; it is aborted once measured."""
MAX_ATTEMPTS = 3
"""A migration that does not commit is counted and measured again with a fresh request."""
WARMUP_SEED = 7777
SOAK_PROMPT = 1024
SOAK_HOP_TOKENS = 8
"""Tokens the soak request decodes between two migrations."""
SOAK_REFRESH_TOKENS = 512
"""Once the soak request decoded this many tokens, a fresh one of SOAK_PROMPT tokens takes its place,
so every migration moves a request of about SOAK_PROMPT tokens."""
LLAMA7B_FLOP_PER_TOKEN = 14e9
LLAMA7B_KV_BYTES_PER_TOKEN = 512 * 1024


@dataclasses.dataclass
class Row:
    length: int
    live_downtime_ms: float
    live_downtime_max_ms: float
    live_total_ms: float
    live_stages: float
    blocking_downtime_ms: float
    recompute_ms: float
    source_step_ms_before: float
    source_step_ms_during: float
    destination_step_ms: float
    """The moved request's decode step at the destination after its first token there (the normal
    inter-token time at that length, which its first step after the move also takes)."""
    attempts: int
    """Migrations tried for this length's live and blocking rows; the ones that did not commit are in
    `not_committed`."""
    not_committed: dict[str, int]


class Node:
    def __init__(self, pair: EnginePair) -> None:
        self.pair = pair
        self.channel = grpc.aio.insecure_channel(pair.grpc_address)
        self.api = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.migration = migration_pb2_grpc.LlumletMigrationStub(self.channel)

    async def restart_llumlet(self, *args: str) -> None:
        await self.pair.llumlet.stop()
        self.pair.llumlet = LlumletProcess(dataclasses.replace(self.pair.llumlet.config, extra_args=args))
        self.pair.llumlet.start()
        await self.pair.llumlet.wait_ready(60)


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    # Ids the tiny tokenizers know (bytes and early merges), varied so no two prompts share a prefix.
    return [(seed * 7919 + i * 104729) % (min(vocab, 400) - 10) + 10 for i in range(length)]


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class Ticker:
    """Token arrival times of one streaming request (the source's other request)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    async def run(self, node: Node, request_id: str, body: dict[str, Any] | None = None,
                  attach: bool = False, stop_after: int | None = None) -> None:
        """Reads the request's tokens (all, or `stop_after` of them, then aborts it)."""
        request = (pb.GenerateRequest(request_id=request_id, attach=True) if attach else
                   pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                                      body_json=json.dumps(body)))
        call = node.api.Generate(request)
        async for message in call:
            self.times.extend(time.perf_counter() for _ in message.chunk.token_ids)
            if stop_after is not None and len(self.times) >= stop_after:
                await node.api.Abort(pb.AbortRequest(request_id=request_id))
                stop_after = None

    def mean_gap_ms(self, start: float, end: float) -> float:
        inside = [t for t in self.times if start <= t <= end]
        if len(inside) < 2:
            return float("nan")
        return (inside[-1] - inside[0]) / (len(inside) - 1) * 1e3


async def _migrate_once(source: Node, destination: Node, length: int, seed: int,
                        vocab: int) -> tuple[mpb.MigrateOutResponse, float, float, float]:
    """Starts a request of `length - DECODE_BEFORE_MOVE` prompt tokens on the source, moves it after
    DECODE_BEFORE_MOVE tokens and lets it finish at the destination; also its mean step time there."""
    request_id = f"bench-{length}-{seed}-{time.monotonic_ns()}"
    body = completion_body(prompt_ids(seed, length - DECODE_BEFORE_MOVE, vocab),
                 DECODE_BEFORE_MOVE + DECODE_AFTER_MOVE + HEADROOM)
    call = source.api.Generate(pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                                                  body_json=json.dumps(body)))
    tokens = 0
    result: mpb.MigrateOutResponse | None = None
    started = ended = 0.0
    async for message in call:
        tokens += len(message.chunk.token_ids)
        if result is None and tokens >= DECODE_BEFORE_MOVE:
            started = time.perf_counter()
            result = await source.migration.MigrateOut(mpb.MigrateOutRequest(
                destination_instance_id=destination.pair.config.instance_id,
                destination_address=destination.pair.grpc_address, request_id=request_id), timeout=600)
            ended = time.perf_counter()
            if result.outcome != mpb.MIGRATION_OUTCOME_COMMITTED:
                await source.api.Abort(pb.AbortRequest(request_id=request_id))
    assert result is not None
    rest = Ticker()
    if result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED:
        try:
            await rest.run(destination, request_id, attach=True, stop_after=DECODE_AFTER_MOVE)
        except grpc.aio.AioRpcError as exc:  # the destination failed the request after its first token
            tqdm.write(f"{length} tokens: the moved request failed at the destination ({exc.details()})")
            result.outcome = mpb.MIGRATION_OUTCOME_ABORTED
    # Over the second half of its tokens there: the tokens buffered before the attach arrive together,
    # and a fast engine's tokens are often streamed several to a chunk.
    later = rest.times[len(rest.times) // 2:]
    return result, started, ended, rest.mean_gap_ms(later[0], later[-1]) if len(later) > 1 else float("nan")


async def _migrate_beside_other(source: Node, destination: Node, length: int, seed: int, vocab: int,
                                other_tokens: int, outcomes: Counter[str]
                                ) -> tuple[mpb.MigrateOutResponse, tuple[float, float, float]]:
    """One migration while another request decodes on the source (the same load for every mode), tried
    up to MAX_ATTEMPTS times until one commits (each attempt's outcome counted in `outcomes`); also that
    request's mean step time in the second before and during the migration, and the moved request's
    step time at the destination. The result is the last attempt's, committed or not."""
    ticker = Ticker()
    other_id = f"other-{length}-{seed}"
    other_body = completion_body(prompt_ids(seed + 9, 64, vocab), other_tokens)
    other = asyncio.create_task(ticker.run(source, other_id, other_body))
    await asyncio.sleep(1.0)
    try:
        for attempt in range(MAX_ATTEMPTS):
            result, started, ended, destination_step_ms = await _migrate_once(
                source, destination, length, seed + 1000 * attempt, vocab)
            outcomes[mpb.MigrationOutcome.Name(result.outcome).removeprefix("MIGRATION_OUTCOME_")] += 1
            if result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED:
                break
            tqdm.write(f"{length} tokens: {mpb.MigrationOutcome.Name(result.outcome)} ({result.reason})")
    finally:
        await source.api.Abort(pb.AbortRequest(request_id=other_id))
        await asyncio.gather(other, return_exceptions=True)
    return result, (ticker.mean_gap_ms(started - 1.0, started), ticker.mean_gap_ms(started, ended),
                    destination_step_ms)


async def _recompute_ms(session: aiohttp.ClientSession, node: Node, length: int, seed: int,
                        vocab: int) -> float:
    """Time to the first token of a fresh prompt of `length` tokens (no KV, no prefix cache)."""
    body = {**completion_body(prompt_ids(seed + 50_000, length, vocab), 1), "stream": True}
    started = time.perf_counter()
    async with session.post(node.pair.engine_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError("the engine streamed no token")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclasses.dataclass
class Soak:
    migrations: int
    outcomes: dict[str, int]
    committed: list[mpb.MigrateOutResponse]
    background: bool
    background_gaps_ms: list[float]
    """Between two tokens of the background requests during the soak: the engines' own stalls."""


async def _soak(a: Node, b: Node, count: int, vocab: int, other_tokens: int, background: bool) -> Soak:
    """`count` migrations in a row of requests of SOAK_PROMPT tokens, SOAK_HOP_TOKENS tokens apart,
    while another request decodes on each engine (`background`)."""
    other_ids = [f"soak-other-{i}" for i in range(2 if background else 0)]
    tickers = [Ticker() for _ in other_ids]
    others = [asyncio.create_task(ticker.run(node, other_id, completion_body(prompt_ids(900 + i, 64, vocab),
                                                                             other_tokens)))
              for i, (ticker, node, other_id) in enumerate(zip(tickers, (a, b), other_ids, strict=False))]
    here, there = a, b
    outcomes: Counter[str] = Counter()
    committed: list[mpb.MigrateOutResponse] = []

    def start(node: Node, serial: int) -> tuple[str, Any]:
        request_id = f"soak-{serial}-{time.monotonic_ns()}"
        body = completion_body(prompt_ids(4242 + serial, SOAK_PROMPT, vocab), SOAK_REFRESH_TOKENS + HEADROOM)
        return request_id, node.api.Generate(pb.GenerateRequest(
            request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION, body_json=json.dumps(body)))

    serial = 0
    request_id, call = start(here, serial)
    began = time.perf_counter()
    tokens = 0
    try:
        for _ in tqdm(range(count), desc="soak", unit="migration"):
            if tokens >= SOAK_REFRESH_TOKENS:
                await here.api.Abort(pb.AbortRequest(request_id=request_id))
                call.cancel()
                serial += 1
                request_id, call = start(here, serial)
                tokens = 0
            target = tokens + SOAK_HOP_TOKENS
            async for message in call:
                tokens += len(message.chunk.token_ids)
                if tokens >= target:
                    break
            result = await here.migration.MigrateOut(mpb.MigrateOutRequest(
                destination_instance_id=there.pair.config.instance_id,
                destination_address=there.pair.grpc_address, request_id=request_id), timeout=600)
            outcomes[mpb.MigrationOutcome.Name(result.outcome).removeprefix("MIGRATION_OUTCOME_")] += 1
            if result.outcome != mpb.MIGRATION_OUTCOME_COMMITTED:
                tqdm.write(f"soak: {mpb.MigrationOutcome.Name(result.outcome)} ({result.reason})")
                tokens = SOAK_REFRESH_TOKENS  # a fresh request next
                continue
            committed.append(result)
            async for message in call:  # the rest of the stream up to Moved
                tokens += len(message.chunk.token_ids)
            here, there = there, here
            call = here.api.Generate(pb.GenerateRequest(request_id=request_id, attach=True))
    finally:
        ended = time.perf_counter()
        call.cancel()
        await here.api.Abort(pb.AbortRequest(request_id=request_id))
        for node, other_id in zip((a, b), other_ids, strict=False):
            await node.api.Abort(pb.AbortRequest(request_id=other_id))
        await asyncio.gather(*others, return_exceptions=True)
    gaps = [1e3 * (t1 - t0) for ticker in tickers
            for t0, t1 in itertools.pairwise(t for t in ticker.times if began <= t <= ended)]
    return Soak(count, dict(outcomes), committed, background, gaps)


async def measure(args: argparse.Namespace, work: Path) -> tuple[list[Row], Soak | None, TinyModelRecipe]:
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(*lengths, SOAK_PROMPT + SOAK_REFRESH_TOKENS)
    max_model_len = longest + DECODE_AFTER_MOVE + HEADROOM + 64
    recipe = dataclasses.replace(PRESETS[MODELS[args.model]], max_position_embeddings=max_model_len + 64)
    model_dir = ensure_tiny_model(REPO / ".cache" / "models", recipe)
    transport = ("--migration-transport", args.transport)
    config = {"model_dir": model_dir, "max_model_len": max_model_len, "kv_cache_gib": args.kv_cache_gib,
              "shutdown_grace_s": 5.0, "engine_start_timeout_s": 600.0, "llumlet_args": transport}
    pairs = [EnginePair(PairConfig(instance_id=name, work_dir=work / name, **config)) for name in ("a", "b")]
    await asyncio.gather(*(p.start() for p in pairs))
    a, b = Node(pairs[0]), Node(pairs[1])
    other_tokens = max_model_len - 80  # runs through every migration of a length
    live: dict[int, list[mpb.MigrateOutResponse]] = {n: [] for n in lengths}
    blocking: dict[int, list[float]] = {n: [] for n in lengths}
    recompute: dict[int, list[float]] = {n: [] for n in lengths}
    slowdown: dict[int, list[tuple[float, float, float]]] = {n: [] for n in lengths}
    outcomes: dict[int, Counter[str]] = {n: Counter() for n in lengths}
    soak: Soak | None = None

    def committed(result: mpb.MigrateOutResponse) -> bool:
        return result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED

    try:
        progress = tqdm(total=len(lengths) * args.repeats * 2, desc="migrations", unit="run")
        async with aiohttp.ClientSession() as session:
            # Not measured: an engine's first migrated-in request and first prefill pay one-off
            # initialisation (hundreds of ms on CPU), which would land on whichever length runs first.
            await _migrate_beside_other(a, b, lengths[0], WARMUP_SEED, recipe.vocab_size, other_tokens,
                                        Counter())
            await _recompute_ms(session, b, lengths[0], WARMUP_SEED, recipe.vocab_size)
            for length in lengths:
                for seed in range(args.repeats):
                    result, gaps = await _migrate_beside_other(a, b, length, seed, recipe.vocab_size,
                                                               other_tokens, outcomes[length])
                    if committed(result):
                        live[length].append(result)
                        slowdown[length].append(gaps)
                    recompute[length].append(await _recompute_ms(session, b, length, seed, recipe.vocab_size))
                    progress.update()
            if args.soak:
                soak = await _soak(a, b, args.soak, recipe.vocab_size, other_tokens, args.soak_background)
            await a.restart_llumlet(*transport, "--migration-max-stages", "0")
            for length in lengths:
                for seed in range(args.repeats):
                    result, _ = await _migrate_beside_other(a, b, length, seed + 100, recipe.vocab_size,
                                                            other_tokens, outcomes[length])
                    if committed(result):
                        blocking[length].append(result.downtime_ms)
                    progress.update()
        progress.close()
    finally:
        await a.channel.close()
        await b.channel.close()
        await asyncio.gather(*(p.stop() for p in pairs), return_exceptions=True)
    rows = [Row(
        length=n,
        live_downtime_ms=_median([r.downtime_ms for r in live[n]]),
        live_downtime_max_ms=max((r.downtime_ms for r in live[n]), default=float("nan")),
        live_total_ms=_median([r.duration_ms for r in live[n]]),
        live_stages=_median([r.stages for r in live[n]]),
        blocking_downtime_ms=_median(blocking[n]),
        recompute_ms=_median(recompute[n]),
        source_step_ms_before=_median([s[0] for s in slowdown[n]]),
        source_step_ms_during=_median([s[1] for s in slowdown[n]]),
        destination_step_ms=_median([s[2] for s in slowdown[n]]),
        attempts=sum(outcomes[n].values()),
        not_committed={k: v for k, v in outcomes[n].items() if k != "COMMITTED"},
    ) for n in lengths]
    return rows, soak, recipe


def _loaded(r: mpb.MigrateOutResponse) -> bool:
    """Whether the destination saw its engine's LOADED event by the first token (the split below)."""
    return r.destination_admitted_ms > 0 or r.destination_kv_load_ms > 0


# The downtime's parts (`downtime_parts`, what the llumlet's histogram records), then the destination's
# own split at its engine's LOADED event; each a function of one committed migration's answer (None:
# not measured).
PART_TITLES = {
    "source_stop": "final stage: the abort into the source engine, the step it waits for",
    "source_kv": "final stage: the last blocks' copy and send",
    "source_event": "final stage: the engine's event to the source llumlet",
    "commit_transit": "Commit's way there and back",
    "destination": "destination: all (Commit received -> first token)",
}
DOWNTIME_PARTS: dict[str, Callable[[mpb.MigrateOutResponse], float | None]] = {
    **{title: (lambda r, part=part: downtime_parts(r)[part]) for part, title in PART_TITLES.items()},
    "destination: resubmission, input processing, scheduling":
        lambda r: r.destination_admitted_ms if _loaded(r) else None,
    "destination: the staged KV's load": lambda r: r.destination_kv_load_ms if _loaded(r) else None,
    "destination: the first step, the token's way to the llumlet":
        lambda r: (r.destination_first_token_ms - r.destination_admitted_ms - r.destination_kv_load_ms
                   if _loaded(r) else None),
}


def _measured_in(part: Callable[[mpb.MigrateOutResponse], float | None],
                 results: list[mpb.MigrateOutResponse]) -> str:
    measured = sum(part(r) is not None for r in results)
    return "" if measured == len(results) else f" ({measured} of {len(results)} measured)"


def soak_report(soak: Soak, worst: int = 3) -> str:
    def figures(values: list[float]) -> str:
        return (f"{_median(values):.1f} / {percentile(values, 0.99):.1f} / "
                f"{max(values, default=float('nan')):.1f}")

    downtime = [r.downtime_ms for r in soak.committed]
    outcomes = ", ".join(f"{name} {count}" for name, count in sorted(soak.outcomes.items()))
    slowest = sorted(soak.committed, key=lambda r: r.downtime_ms, reverse=True)[:worst]
    return "\n".join([
        f"{soak.migrations} migrations in a row of requests of {SOAK_PROMPT}-"
        f"{SOAK_PROMPT + SOAK_REFRESH_TOKENS} tokens, {SOAK_HOP_TOKENS} tokens apart, "
        + ("another request decoding on each engine" if soak.background else "nothing else running")
        + f": {outcomes}.",
        "",
        "| committed | downtime ms (median / P99 / max) | pair -> commit ms (median / P99 / max) "
        "| over 1 s |",
        "|---:|---:|---:|---:|",
        f"| {len(downtime)} | {figures(downtime)} | {figures([r.duration_ms for r in soak.committed])} | "
        f"{sum(d > 1000 for d in downtime)} |",
        "",
        *([f"Meanwhile the background requests' gap between two tokens (each engine's own stalls), ms "
           f"(median / P99 / max): {figures(soak.background_gaps_ms)}, over {len(soak.background_gaps_ms)} "
           "gaps.", ""] if soak.background_gaps_ms else []),
        f"The downtime's parts, ms (median / P99 / max; then the {worst} longest downtimes):",
        "",
        "| part | median / P99 / max | " + " | ".join(f"{r.downtime_ms:.0f} ms" for r in slowest) + " |",
        "|---|---:|" + "---:|" * len(slowest),
        *(f"| {name}{_measured_in(part, soak.committed)} | "
          f"{figures([v for r in soak.committed if (v := part(r)) is not None])} | "
          + " | ".join("-" if (v := part(r)) is None else f"{v:.1f}" for r in slowest) + " |"
          for name, part in DOWNTIME_PARTS.items()),
    ])


def compute_per_kv_byte(recipe: TinyModelRecipe) -> tuple[float, int]:
    """Prefill FLOP per token (2 x parameters) and KV bytes per token of the recipe's model."""
    bytes_per_value = 4 if recipe.dtype == "float32" else 2
    mlp = 3 * recipe.hidden * recipe.intermediate_size
    attention = recipe.hidden * recipe.head_dim * (2 * recipe.heads + 2 * recipe.kv_heads)
    params = recipe.layers * (mlp + attention) + 2 * recipe.vocab_size * recipe.hidden
    kv_bytes = 2 * recipe.layers * recipe.kv_heads * recipe.head_dim * bytes_per_value
    return 2.0 * params, kv_bytes


def report(rows: list[Row], recipe: TinyModelRecipe, model: str) -> str:
    flop, kv_bytes = compute_per_kv_byte(recipe)
    ratio = flop / kv_bytes
    llama = LLAMA7B_FLOP_PER_TOKEN / LLAMA7B_KV_BYTES_PER_TOKEN
    lines = [
        f"Model `{model}`: {flop / 1e6:.1f} MFLOP prefill per token, {kv_bytes} B of KV per token "
        f"({ratio:.0f} FLOP per KV byte; LLaMA-7B: {llama:.0f}, {llama / ratio:.1f}x more compute per byte "
        f"moved, so recompute costs relatively that much more there).",
        "",
        "| tokens | live downtime ms (median / max) | live total ms | stages | blocking copy downtime ms "
        "| recompute ms | source step ms (before / during) | destination step ms | not committed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [f"| {r.length} | {r.live_downtime_ms:.1f} / {r.live_downtime_max_ms:.1f} "
              f"| {r.live_total_ms:.1f} | {r.live_stages:.0f} | {r.blocking_downtime_ms:.1f} "
              f"| {r.recompute_ms:.1f} | {r.source_step_ms_before:.1f} / {r.source_step_ms_during:.1f} "
              f"| {r.destination_step_ms:.1f} | {_not_committed(r)} |" for r in rows]
    return "\n".join(lines)


def _not_committed(row: Row) -> str:
    failed = sum(row.not_committed.values())
    if not failed:
        return f"0 of {row.attempts}"
    reasons = ", ".join(f"{name} {count}" for name, count in sorted(row.not_committed.items()))
    return f"{failed} of {row.attempts}: {reasons}"


def plot(rows: list[Row], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r.length for r in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(lengths, [r.live_downtime_ms for r in rows], "o-", label="live migration (downtime)")
    axis.plot(lengths, [r.blocking_downtime_ms for r in rows], "s-", label="blocking copy")
    axis.plot(lengths, [r.recompute_ms for r in rows], "^-", label="recompute")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("downtime (ms)")
    axis.set_title(f"Migration downtime, CPU vLLM, model {model}")
    axis.legend()
    axis.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--lengths", default="256,1024,2048,4096,8192", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--soak", type=int, default=0, metavar="N",
                        help="then N migrations in a row of one request under background decoding (0: none)")
    parser.add_argument("--soak-background", action=argparse.BooleanOptionalAction, default=True,
                        help="keep another request decoding on each engine during the soak (the target's "
                        "setting); --no-soak-background shows what the engines' own decoding costs")
    parser.add_argument("--transport", choices=("auto", "tcp", "gloo", "nccl"), default="auto",
                        help="both llumlets' --migration-transport (the KV channel; auto: tcp on CPU); "
                             "the output files of another than auto are named _<transport>")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures")
    parser.add_argument("--work-dir", type=Path, help="keep the engines' and llumlets' logs here "
                        "(default: a temporary directory)")
    args = parser.parse_args()
    if args.work_dir is not None:
        rows, soak, recipe = run_cleanly(measure(args, args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="llumnix-migration-bench-") as tmp:
            rows, soak, recipe = run_cleanly(measure(args, Path(tmp)))
    text = f"KV channel: {args.transport}.\n\n" + report(rows, recipe, args.model)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.model if args.transport == "auto" else f"{args.model}_{args.transport}"
    if soak is not None:
        soak_text = soak_report(soak)
        print("\n" + soak_text)
        (args.out / f"migration_soak_{name}.md").write_text(soak_text + "\n")
        (args.out / f"migration_soak_{name}.json").write_text(
            json.dumps({"migrations": soak.migrations, "outcomes": soak.outcomes,
                        "background": soak.background, "background_gaps_ms": soak.background_gaps_ms,
                        "committed": [MessageToDict(r, preserving_proto_field_name=True)
                                      for r in soak.committed]}, indent=2) + "\n")
    (args.out / f"migration_downtime_{name}.md").write_text(text + "\n")
    (args.out / f"migration_downtime_{name}.json").write_text(
        json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    plot(rows, args.model, args.out / f"migration_downtime_{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
