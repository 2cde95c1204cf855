"""What the router costs and how many streams it sustains, with sim engines.

    .venv/bin/python bench/router_overhead.py [--requests 200 --concurrency 8] [--streams 500 --instances 4]

1. Overhead: one sim engine + llumlet; the same streaming requests (64-token prompt, 64 output
   tokens, `--concurrency` in flight) sent to the llumlet's own HTTP front directly and through the
   router (`llumnix router` process -> llumlet gRPC). TTFT p50/p99 and time per output token.
2. Concurrency: `--streams` streaming requests at once through the router over `--instances` sim
   engines (100 output tokens each); errors, and how long they took against the engines' own pace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from llumnix.bench import BenchConfig, BenchResult, run_bench
from llumnix.launch.pair import EnginePair, PairConfig, free_port
from llumnix.traces import TraceRequest

MODEL = "sim"


async def start_router(addresses: list[str], work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(work / "router.log", "ab")  # noqa: SIM115 - the router process writes it
    process = subprocess.Popen([sys.executable, "-m", "llumnix.cli", "router", "--model", MODEL,
                                "--host", "127.0.0.1", "--port", str(port),
                                "--instances", ",".join(addresses),
                                "--queue-size", "4096", "--log-level", "warning"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as response:
                    body = await response.json()
                    if body.get("instances_ready") == len(addresses):
                        return process, url
            await asyncio.sleep(0.1)
    raise RuntimeError(f"router not ready; log {work / 'router.log'}")


def sim_pair(instance_id: str, work: Path, **config: int) -> EnginePair:
    """A sim engine with the profile's block size and a 4,096-token context, and its llumlet."""
    return EnginePair(PairConfig(instance_id=instance_id, work_dir=work / instance_id, engine="sim",
                                 served_model_name=MODEL, block_size=16, max_model_len=4096, **config))


def stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    process.wait(30)


def fixed_trace(requests: int, prompt: int, output: int) -> list[TraceRequest]:
    return [TraceRequest(i, 0.0, prompt, output) for i in range(requests)]


def describe(name: str, result: BenchResult) -> dict[str, float | int]:
    s = result.summary()
    print(f"{name:<22} TTFT p50 {s['prefill_p50'] * 1e3:7.1f} ms  p99 {s['prefill_p99'] * 1e3:7.1f} ms  "
          f"per token mean {s['decode_mean'] * 1e3:6.2f} ms  p99 {s['decode_p99'] * 1e3:6.2f} ms  "
          f"finished {s['finished']}/{s['requests']}  errors {s['errors']} {result.errors_by_kind or ''}  "
          f"in {s['duration']:.1f} s", flush=True)
    return s


async def overhead(args: argparse.Namespace, work: Path) -> None:
    instance = sim_pair("overhead", work)
    await instance.start()
    router, url = await start_router([instance.grpc_address], work)
    try:
        trace = fixed_trace(args.requests, 64, 64)
        results = {}
        for name, target in (("llumlet HTTP (direct)", instance.llumlet.http_url),
                             ("router -> llumlet", url)):
            config = BenchConfig(url=target, model=MODEL, max_concurrency=args.concurrency,
                                 show_progress=False)
            results[name] = describe(name, await run_bench(config, trace))
        direct, routed = results.values()
        print(f"router adds: TTFT p50 {(routed['prefill_p50'] - direct['prefill_p50']) * 1e3:+.1f} ms, "
              f"p99 {(routed['prefill_p99'] - direct['prefill_p99']) * 1e3:+.1f} ms, per token "
              f"{(routed['decode_mean'] - direct['decode_mean']) * 1e3:+.2f} ms")
    finally:
        stop(router)
        await instance.stop()


async def concurrency(args: argparse.Namespace, work: Path) -> None:
    instances = [sim_pair(f"conc-{i}", work, max_num_seqs=256) for i in range(args.instances)]
    await asyncio.gather(*(i.start() for i in instances))
    router, url = await start_router([i.grpc_address for i in instances], work)
    try:
        started = time.monotonic()
        config = BenchConfig(url=url, model=MODEL, show_progress=True, timeout_s=1200)
        describe(f"{args.streams} streams", await run_bench(config, fixed_trace(args.streams, 32, 100)))
        print(f"all {args.streams} streams done in {time.monotonic() - started:.1f} s")
    finally:
        stop(router)
        await asyncio.gather(*(i.stop() for i in instances))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--skip", choices=["overhead", "concurrency"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        work = Path(tmp)
        if args.skip != "overhead":
            asyncio.run(overhead(args, work))
        if args.skip != "concurrency":
            asyncio.run(concurrency(args, work))


if __name__ == "__main__":
    main()
