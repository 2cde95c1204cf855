"""What the llumlet adds: time to first token (p50/p99) and per-token latency through the llumlet
(HTTP front and gRPC Generate) against calling the engine directly, and the latency from an engine
step to a WatchLoad subscriber.

Starts one CPU vLLM engine with the llumnix connector plus its llumlet (the tiny test model), sends
the same streaming greedy requests round-robin to the three paths (so drift hits them equally), and
prints a table (and JSON with --json).

    .venv/bin/python bench/llumlet_overhead.py --requests 60 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import grpc
from bench_stats import percentile
from tqdm import tqdm

from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.tiny_model import TinyModelRecipe, ensure_tiny_model
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc

REPO = Path(__file__).resolve().parent.parent

Timing = tuple[float, float, int]
"""(time to first token, mean time per output token after the first, tokens)."""


async def via_http(session: aiohttp.ClientSession, base_url: str, body: dict) -> Timing:
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(base_url + "/v1/completions", json={**body, "stream": True,
                                                                  "return_token_ids": True}) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            new = sum(len(c.get("token_ids") or ()) for c in choices)
            if new:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += new
    return first - start, (last - first) / max(1, tokens - 1), tokens


async def via_grpc(stub: llumlet_pb2_grpc.LlumletStub, body: dict, request_id: str) -> Timing:
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    request = pb.GenerateRequest(request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION,
                                 body_json=json.dumps(body))
    async for event in stub.Generate(request):
        if event.chunk.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(event.chunk.token_ids)
    return first - start, (last - first) / max(1, tokens - 1), tokens


async def watch_latency(address: str, min_interval_ms: int, stop: asyncio.Event) -> list[float]:
    """Receive time minus the engine's snapshot timestamp, for every load that carries a new step."""
    delays: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        stream = stub.WatchLoad(pb.WatchLoadRequest(min_interval_ms=min_interval_ms))
        last_ts = 0.0
        async for load in stream:
            if stop.is_set():
                stream.cancel()
                break
            if load.source == pb.LOAD_SOURCE_CONNECTOR and load.timestamp > last_ts and load.running:
                delays.append(time.time() - load.timestamp)
                last_ts = load.timestamp
    return delays


async def run(args: argparse.Namespace) -> dict:
    model = ensure_tiny_model(REPO / ".cache" / "models", TinyModelRecipe())
    with tempfile.TemporaryDirectory(prefix="llumlet-bench-") as work:
        pair = EnginePair(PairConfig(instance_id="bench-0", model_dir=model, work_dir=Path(work)))
        print("starting engine + llumlet ...", file=sys.stderr)
        await pair.start()
        try:
            return await measure(pair, args)
        finally:
            await pair.stop()


async def measure(pair: EnginePair, args: argparse.Namespace) -> dict:
    body = {"model": pair.served_model_name, "prompt": list(range(10, 10 + args.prompt_tokens)),
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    results: dict[str, list[Timing]] = {"direct": [], "llumlet-http": [], "llumlet-grpc": []}
    # Idle connections are dropped before the servers drop them (uvicorn: 5 s), so none is reused stale.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session, \
            grpc.aio.insecure_channel(pair.llumlet.grpc_address) as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        paths: dict[str, Callable[[int], Awaitable[Timing]]] = {
            "direct": lambda i: via_http(session, pair.engine_url, body),
            "llumlet-http": lambda i: via_http(session, pair.llumlet.http_url, body),
            "llumlet-grpc": lambda i: via_grpc(stub, body, f"bench-{i}"),
        }
        for name in paths:  # warm-up
            await paths[name](-1 - len(name))
        stop_watch = asyncio.Event()
        watchers = {ms: asyncio.create_task(watch_latency(pair.llumlet.grpc_address, ms, stop_watch))
                    for ms in args.watch_intervals_ms}
        queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        for i in range(args.requests):
            for name in paths:
                queue.put_nowait((i, name))
        progress = tqdm(total=queue.qsize(), desc="requests", file=sys.stderr)

        async def worker() -> None:
            while not queue.empty():
                i, name = queue.get_nowait()
                results[name].append(await paths[name](i))
                progress.update()

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        progress.close()
        stop_watch.set()
        # Wake the watchers with one more request so they observe the stop flag.
        await paths["direct"](0)
        watch = {ms: await task for ms, task in watchers.items()}
    summary: dict = {"requests_per_path": args.requests, "concurrency": args.concurrency,
                     "watch_intervals_ms": args.watch_intervals_ms,
                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "paths": {}}
    for name, timings in results.items():
        ttft = [t[0] * 1e3 for t in timings]
        tpot = [t[1] * 1e3 for t in timings]
        summary["paths"][name] = {
            "ttft_p50_ms": percentile(ttft, 0.50), "ttft_p99_ms": percentile(ttft, 0.99),
            "tpot_mean_ms": statistics.fmean(tpot), "tpot_p50_ms": percentile(tpot, 0.50)}
    direct = summary["paths"]["direct"]
    for name in ("llumlet-http", "llumlet-grpc"):
        path = summary["paths"][name]
        path["added_ttft_p50_ms"] = path["ttft_p50_ms"] - direct["ttft_p50_ms"]
        path["added_ttft_p99_ms"] = path["ttft_p99_ms"] - direct["ttft_p99_ms"]
        path["added_tpot_mean_ms"] = path["tpot_mean_ms"] - direct["tpot_mean_ms"]
    summary["snapshot_to_subscriber_ms"] = {
        f"min_interval_{ms}ms": {"samples": len(d), "p50": percentile([x * 1e3 for x in d], 0.50),
                                 "p99": percentile([x * 1e3 for x in d], 0.99)}
        for ms, d in watch.items() if d
    }
    return summary


def print_table(summary: dict) -> None:
    print(f"{summary['requests_per_path']} streaming greedy requests per path, concurrency "
          f"{summary['concurrency']}, prompt {summary['prompt_tokens']} tokens, {summary['max_tokens']} "
          "output tokens")
    print(f"{'path':<14}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT mean':>11}{'+TTFT p50':>11}{'+TTFT p99':>11}"
          f"{'+TPOT':>9}  (ms)")
    for name, p in summary["paths"].items():
        print(f"{name:<14}{p['ttft_p50_ms']:>10.2f}{p['ttft_p99_ms']:>10.2f}{p['tpot_mean_ms']:>11.3f}"
              f"{p.get('added_ttft_p50_ms', 0):>11.2f}{p.get('added_ttft_p99_ms', 0):>11.2f}"
              f"{p.get('added_tpot_mean_ms', 0):>9.3f}")
    for name, s in summary["snapshot_to_subscriber_ms"].items():
        print(f"engine step -> WatchLoad subscriber ({name}): p50 {s['p50']:.2f} ms, p99 {s['p99']:.2f} ms "
              f"({s['samples']} loads)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="requests per path (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--watch-intervals-ms", type=int, nargs="+", default=[50], metavar="MS",
                        help="one WatchLoad subscriber per minimum interval, as a router would hold "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print_table(summary)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
