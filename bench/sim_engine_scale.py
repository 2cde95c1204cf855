"""How light `llumnix sim-engine` is: start-up time and memory of many engines, and how many concurrent
streams one engine keeps in real time.

    .venv/bin/python bench/sim_engine_scale.py [--engines 16] [--streams 64,128,256,512]

Start-up: N engines launched at once, seconds until every /health answers; RSS of each, idle and
after serving. Streams: C streaming requests at once on one engine (time scale 1, the default
profile); the clients' mean inter-token time against the profile's decode iteration time for a
batch of C. A ratio near 1 means the engine (and this client, on the same cores) keeps real time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from llumnix.launch.pair import free_port
from llumnix.profile import DEFAULT_PROFILE, load_profile


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _launch(port: int, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "llumnix.sim_engine", "--port", str(port), "--log-level", "warning", *flags]
    )


async def _wait_healthy(session: aiohttp.ClientSession, url: str) -> None:
    while True:
        try:
            async with session.get(url + "/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.02)


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt_tokens: int, max_tokens: int
) -> list[float]:
    """Arrival times of the request's tokens."""
    body = {"prompt": [7] * prompt_tokens, "max_tokens": max_tokens, "stream": True}
    arrivals: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
                json.loads(line[6:])
    return arrivals


async def startup(engines: int) -> None:
    ports = [free_port() for _ in range(engines)]
    started = time.monotonic()
    processes = [_launch(port) for port in ports]
    try:
        async with aiohttp.ClientSession() as session:
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            await asyncio.gather(*(_wait_healthy(session, url) for url in urls))
            ready_s = time.monotonic() - started
            start_cpu = statistics.mean(_cpu_s(p.pid) for p in processes)
            idle = [_rss_mib(p.pid) for p in processes]
            await asyncio.gather(*(_stream(session, url, 64, 64) for url in urls for _ in range(8)))
            served = [_rss_mib(p.pid) for p in processes]
        print(
            f"{engines} engines healthy after {ready_s:.2f} s ({start_cpu:.2f} CPU-s each); "
            f"RSS idle {statistics.mean(idle):.1f} MiB "
            f"(max {max(idle):.1f}), after 8 streams each {statistics.mean(served):.1f} MiB "
            f"(max {max(served):.1f})"
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait()


async def streams(levels: list[int], prompt_tokens: int, max_tokens: int) -> None:
    profile = load_profile(DEFAULT_PROFILE)
    port = free_port()
    process = _launch(
        port, "--num-blocks", "100000", "--max-num-seqs", str(max(levels)), "--max-model-len", "4096"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=600)
        ) as session:
            await _wait_healthy(session, url)
            for concurrency in levels:
                cpu_before = _cpu_s(process.pid)
                results = await asyncio.gather(
                    *(_stream(session, url, prompt_tokens, max_tokens) for _ in range(concurrency))
                )
                # From the second token on: the first gap may include other requests' prefills.
                gaps = [b - a for arrivals in results for a, b in itertools.pairwise(arrivals[1:])]
                context = concurrency * (prompt_tokens + max_tokens // 2)
                expected = profile.decode_time(concurrency, context)
                itl = statistics.mean(gaps)
                tokens = sum(len(arrivals) for arrivals in results)
                cpu_us = 1e6 * (_cpu_s(process.pid) - cpu_before) / tokens
                print(
                    f"{concurrency:5d} streams: mean inter-token {1000 * itl:6.1f} ms, profile decode step "
                    f"{1000 * expected:6.1f} ms, ratio {itl / expected:4.2f}; "
                    f"engine {cpu_us:.0f} CPU-us per streamed token, RSS {_rss_mib(process.pid):.1f} MiB"
                )
    finally:
        process.terminate()
        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--streams", default="64,128,256,512", help="concurrency levels, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    asyncio.run(startup(args.engines))
    asyncio.run(streams([int(c) for c in args.streams.split(",")], args.prompt_tokens, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
