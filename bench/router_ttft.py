"""Where the time to first token goes at light load: one sim engine, its llumlet and `llumnix router`,
each path loaded by `--concurrency` streams of 64-token prompts; prints each path's client-side TTFT and,
for the llumnix path, the router's own TTFT (arrival to the first token sent) and the llumlet's share
(admission to the engine's first chunk), read from their /metrics; then the round trip of one small
message on an idle grpc.aio bidi stream between two processes (the transport's floor).

    .venv/bin/python bench/router_ttft.py                          # 4 streams, time scale 20
    .venv/bin/python bench/router_ttft.py --time-scale 200         # the data-path benchmark's engine speed
    .venv/bin/python bench/router_ttft.py --split-cores            # the hops on cores of their own

At time scale 20 four streams make about 800 tokens/s, which keeps the hops' loops mostly idle; at 200
(8,000 tokens/s) the hops' CPU per token fills a core and the TTFT grows with their queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import uvloop
from bench_service import client_session, metric_values, stream_completion
from router_peer import split_cores, start_paths

from llumnix.launch.pair import free_port

ROUTER_TTFT = "llumnix_router_time_to_first_token_seconds"
LLUMLET_FIRST_CHUNK = "llumnix_llumlet_engine_first_chunk_seconds"
ECHO_SERVICE = "llumnix.bench.Echo"


async def load(url: str, concurrency: int, total: int, output_tokens: int) -> list[float]:
    """`total` requests, `concurrency` at a time; each one's TTFT."""
    ttfts: list[float] = []
    left = list(range(total))
    async with client_session() as session:
        async def stream_after_stream() -> None:
            while left:
                seed = left.pop()
                prompt = [1 + (seed + i) % 500 for i in range(64)]
                result = await stream_completion(session, url, "bench", prompt, output_tokens, 120.0)
                if not result.complete() or result.first_token is None:
                    raise RuntimeError(f"{url}: a request did not complete: {result}")
                ttfts.append(result.first_token - result.started)
        await asyncio.gather(*(stream_after_stream() for _ in range(concurrency)))
    return ttfts


async def histogram_sum_count(url: str, name: str) -> tuple[float, float]:
    async with client_session() as session:
        values = await metric_values(session, url, (f"{name}_sum", f"{name}_count"))
    return values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)


async def paths_ttft(args: argparse.Namespace) -> None:
    bench_args = argparse.Namespace(engine="sim", time_scale=args.time_scale, input_len=64,
                                    output_len=args.output_tokens, max_num_seqs=256, no_peer=True,
                                    router_workers=[1])
    with tempfile.TemporaryDirectory(prefix="router-ttft-") as tmp:
        pair, services, paths = await start_paths(bench_args, Path(tmp), None)
        try:
            if args.split_cores:
                pids = {"engine": pair.engine.pid, "llumlet": pair.llumlet.pid,
                        **{service.name: service.pid for service in services}}
                os.sched_setaffinity(0, split_cores(pids))  # the client beside the engine
            router_url = paths[-1].url
            for path in paths:
                await load(path.url, args.concurrency, 20, args.output_tokens)  # warm-up
                router_before = await histogram_sum_count(router_url, ROUTER_TTFT)
                llumlet_before = await histogram_sum_count(pair.llumlet.http_url, LLUMLET_FIRST_CHUNK)
                ttfts = await load(path.url, args.concurrency, args.requests, args.output_tokens)
                router_after = await histogram_sum_count(router_url, ROUTER_TTFT)
                llumlet_after = await histogram_sum_count(pair.llumlet.http_url, LLUMLET_FIRST_CHUNK)
                line = (f"{path.name:<15} TTFT p50 {statistics.median(ttfts) * 1e3:6.2f} ms  "
                        f"mean {statistics.mean(ttfts) * 1e3:6.2f} ms")
                for label, before, after in (("router's own", router_before, router_after),
                                             ("llumlet to engine's first chunk", llumlet_before,
                                              llumlet_after)):
                    count = after[1] - before[1]
                    if count:
                        line += f"  {label} mean {(after[0] - before[0]) / count * 1e3:6.2f} ms"
                print(line, flush=True)
        finally:
            await asyncio.gather(*(service.terminate() for service in services))
            await pair.stop()


def _echo_server(port: int) -> None:
    async def serve() -> None:
        async def echo(messages, _context):  # type: ignore[no-untyped-def]
            async for message in messages:
                yield message

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            ECHO_SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(echo)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


async def grpc_round_trip(port: int, messages: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        call = channel.stream_stream(f"/{ECHO_SERVICE}/Stream")()
        times = []
        for _ in range(messages):
            start = time.perf_counter()
            await call.write(b"x" * 64)
            await call.read()
            times.append(time.perf_counter() - start)
        await call.done_writing()
    return times[messages // 10:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200, help="measured requests per path")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--time-scale", type=float, default=20.0,
                        help="sim engine speed-up over the default profile (default: %(default)s)")
    parser.add_argument("--split-cores", action="store_true",
                        help="engine and client on half the cores, the llumlet and the router on the rest")
    args = parser.parse_args()
    uvloop.run(paths_ttft(args))

    port = free_port()
    server = multiprocessing.Process(target=_echo_server, args=(port,), daemon=True)
    server.start()
    try:
        times = sorted(uvloop.run(grpc_round_trip(port, 2000)))
    finally:
        server.terminate()
    print(f"grpc.aio bidi stream round trip, idle: p50 {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
