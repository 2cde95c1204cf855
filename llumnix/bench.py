"""Replay a trace against any OpenAI-compatible endpoint (the router, a llumlet, vLLM) with real
streaming, and report time to first token, per-token decode and end-to-end latency.

    llumnix bench --url http://127.0.0.1:8000 --trace M-M --requests 200 --rate 4 \
        --json out.json --plot out.png

Requests follow `llumnix.traces.generate_trace` (or a dataset file): arrival times, prompt text sized
to the trace's prompt tokens (`--chars-per-token`: 1 for the sim engine's byte tokenizer), max_tokens
= the trace's output tokens with ignore_eos. The JSON has the keys of `llumnix simulate --json`
(seconds) plus P50s, errors and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from llumnix.traces import TRACE_PRESETS, TraceRequest, generate_trace

PROMPT_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class BenchConfig:
    url: str
    model: str | None = None
    """None: the first model of GET /v1/models."""
    endpoint: str = "completions"
    chars_per_token: float = 1.0
    ignore_eos: bool = True
    api_key: str | None = None
    priority_header: str = "x-llumnix-priority"
    max_concurrency: int | None = None
    timeout_s: float = 600.0
    show_progress: bool = True


@dataclass
class RequestResult:
    request_id: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    error: str | None = None
    high_priority: bool = False

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        assert self.finish is not None
        return self.finish - self.arrival

    @property
    def per_token(self) -> float:
        """Mean time per output token after the first."""
        assert self.finish is not None and self.first_token is not None and self.output_tokens > 1
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass
class BenchResult:
    results: list[RequestResult]
    duration_s: float
    errors_by_kind: dict[str, int] = field(default_factory=dict)

    def completed(self) -> list[RequestResult]:
        return [r for r in self.results
                if r.error is None and r.finish is not None and r.first_token is not None]

    def summary(self) -> dict[str, float | int]:
        done = self.completed()
        prefill = np.array([r.ttft for r in done])
        e2e = np.array([r.e2e for r in done])
        decode = np.array([r.per_token for r in done if r.output_tokens > 1])
        stats: dict[str, float | int] = {}
        for name, values in (("prefill", prefill), ("decode", decode), ("e2e", e2e)):
            stats[f"{name}_mean"] = float(values.mean()) if values.size else 0.0
            stats[f"{name}_p50"] = float(np.percentile(values, 50)) if values.size else 0.0
            stats[f"{name}_p99"] = float(np.percentile(values, 99)) if values.size else 0.0
        stats["finished"] = len(done)
        stats["errors"] = len(self.results) - len(done)
        stats["requests"] = len(self.results)
        stats["duration"] = self.duration_s
        stats["output_tokens_per_s"] = sum(r.output_tokens for r in done) / max(self.duration_s, 1e-9)
        return stats


def prompt_text(tokens: int, chars_per_token: float, seed: int) -> str:
    """Text of about `tokens` tokens; varied per request so no two prompts share a long prefix."""
    length = max(1, round(tokens * chars_per_token))
    start = seed % len(PROMPT_ALPHABET)
    unit = PROMPT_ALPHABET[start:] + PROMPT_ALPHABET[:start]
    return (unit * (length // len(unit) + 1))[:length]


def request_body(config: BenchConfig, model: str, request: TraceRequest) -> dict[str, Any]:
    text = prompt_text(request.prompt_tokens, config.chars_per_token, request.request_id)
    body: dict[str, Any] = {"model": model, "max_tokens": request.output_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def discover_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as response:
        payload = await response.json(content_type=None)
        if response.status != 200 or not payload.get("data"):
            raise ValueError(f"{url}/v1/models answered {response.status}; give --model")
        return str(payload["data"][0]["id"])


async def _one(session: aiohttp.ClientSession, config: BenchConfig, model: str, request: TraceRequest
               ) -> RequestResult:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    headers = {config.priority_header: "high"} if request.high_priority else {}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    result = RequestResult(request.request_id, time.monotonic(), high_priority=request.high_priority)
    counted = 0
    try:
        async with session.post(config.url + path, json=request_body(config, model, request),
                                headers=headers) as response:
            if response.status != 200:
                result.error = f"http-{response.status}"
                await response.read()
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = "stream-error"
                    return result
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                for choice in payload.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = choice.get("text") if "text" in choice else delta.get("content")
                    if text:
                        counted += 1
                        if result.first_token is None:
                            result.first_token = time.monotonic()
            result.finish = time.monotonic()
            result.output_tokens = result.output_tokens or counted
            if result.first_token is None:
                result.error = "no-output"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = type(exc).__name__
    return result


async def run_bench(config: BenchConfig, trace: Sequence[TraceRequest]) -> BenchResult:
    """Sends every request at its arrival time (relative to now) and waits for all of them."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await discover_model(session, config.url)
        start = time.monotonic()
        bar = tqdm(total=len(trace), unit="req", disable=not config.show_progress, desc="bench")

        async def scheduled(request: TraceRequest) -> RequestResult:
            delay = start + request.arrival_time - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                result = await _one(session, config, model, request)
            else:
                async with limit:
                    result = await _one(session, config, model, request)
            bar.update(1)
            return result

        try:
            results = list(await asyncio.gather(*(scheduled(r) for r in trace)))
        finally:
            bar.close()
        duration = time.monotonic() - start
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return BenchResult(results, duration, errors)


def plot_cdfs(result: BenchResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = result.completed()
    series = {
        "time to first token (s)": [r.ttft for r in done],
        "decode time per token (s)": [r.per_token for r in done if r.output_tokens > 1],
        "end-to-end latency (s)": [r.e2e for r in done],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_summary(summary: dict[str, float | int], errors: dict[str, int]) -> str:
    lines = [f"{'':<10}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for name, label in (("prefill", "TTFT"), ("decode", "per-token"), ("e2e", "e2e")):
        cells = "".join(f"{summary[f'{name}_{k}'] * 1e3:>8.1f}ms" for k in ("mean", "p50", "p99"))
        lines.append(f"{label:<10}{cells}")
    lines.append(f"finished {summary['finished']}/{summary['requests']} in {summary['duration']:.1f} s, "
                 f"{summary['output_tokens_per_s']:.0f} output tokens/s, errors {summary['errors']}"
                 + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(errors.items()))})" if errors else ""))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="endpoint base URL (default: %(default)s)")
    parser.add_argument("--model", help="model name (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--trace", default="M-M",
                        help=f"length distribution: one of {', '.join(TRACE_PRESETS)} (default: %(default)s)")
    parser.add_argument("--dataset", metavar="FILE",
                        help="ShareGPT JSON/JSONL or BurstGPT CSV instead of --trace")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (default: %(default)s)")
    parser.add_argument("--cv", type=float, default=1.0, help="arrival burstiness; 1 = Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--high-priority-fraction", type=float, default=0.0, metavar="F")
    parser.add_argument("--max-total-tokens", type=int, default=4096,
                        help="cap of prompt + output tokens per request (default: %(default)s)")
    parser.add_argument("--chars-per-token", type=float, default=1.0,
                        help="prompt characters per trace token: 1 for the sim engine, about 4 for "
                        "English on a LLaMA tokenizer (default: %(default)s)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    parser.add_argument("--plot", metavar="FILE", help="write latency CDFs as a PNG")


def run(args: argparse.Namespace) -> int:
    try:
        trace = generate_trace(args.dataset or args.trace, args.requests, args.rate, args.cv, args.seed,
                               args.high_priority_fraction, args.max_total_tokens)
    except ValueError as exc:
        print(f"llumnix bench: {exc}", file=sys.stderr)
        return 2
    config = BenchConfig(url=args.url.rstrip("/"), model=args.model, endpoint=args.endpoint,
                         chars_per_token=args.chars_per_token, ignore_eos=not args.no_ignore_eos,
                         api_key=args.api_key, max_concurrency=args.max_concurrency)
    try:
        result = asyncio.run(run_bench(config, trace))
    except (ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"llumnix bench: cannot benchmark {config.url}: {exc}", file=sys.stderr)
        return 1
    summary = result.summary()
    print(format_summary(summary, result.errors_by_kind))
    if args.json:
        report = {**summary, "error_kinds": result.errors_by_kind}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        plot_cdfs(result, Path(args.plot), f"{config.url} · {args.dataset or args.trace} · "
                  f"{args.requests} requests at {args.rate:g}/s")
        print(f"wrote {args.plot}")
    return 0 if summary["finished"] else 1
