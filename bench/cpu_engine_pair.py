"""Two CPU vLLM engines decoding side by side: tokens per second and the gaps between a stream's
tokens, at 1 and 8 concurrent streams per engine, under the launcher's shm-queue reader bounds or
vLLM's own (spin 1 s, recheck 5 s). This is the measurement behind llumnix/engine/vllm_shm_wait.py.

    .venv/bin/python bench/cpu_engine_pair.py                       # the launcher's bounds
    .venv/bin/python bench/cpu_engine_pair.py --busy-s 1 --recheck-ms 5000   # vLLM's defaults
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from bench_stats import percentile

from llumnix.engine.vllm_shm_wait import BUSY_ENV, RECHECK_ENV
from llumnix.launch.engine_process import (
    SHM_READER_BUSY_S,
    SHM_READER_RECHECK_MS,
    EngineLaunchConfig,
    EngineProcess,
)
from llumnix.launch.pair import free_port
from llumnix.tiny_model import TinyModelRecipe, ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int) -> tuple[int, list[float]]:
    body = {"model": "tiny", "prompt": [5 + i for i in range(40)], "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    gaps: list[float] = []
    last, count = time.monotonic(), 0
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                now = time.monotonic()
                gaps.append(now - last)
                last, count = now, count + 1
    return count, gaps[1:]


async def measure(args: argparse.Namespace, work: Path) -> None:
    model = ensure_tiny_model(REPO / ".cache" / "models", TinyModelRecipe())
    env = {BUSY_ENV: str(args.busy_s), RECHECK_ENV: str(args.recheck_ms)}
    engines = [EngineProcess(EngineLaunchConfig(model=model, port=free_port(), served_model_name="tiny",
                                                dtype="float32", max_model_len=1024, extra_env=env,
                                                log_path=work / f"engine-{i}.log")) for i in range(2)]
    await asyncio.gather(*(engine.start(timeout_s=600) for engine in engines))
    try:
        async with aiohttp.ClientSession() as session:
            print(f"shm readers: spin {args.busy_s} s, recheck {args.recheck_ms} ms; "
                  f"{args.tokens} tokens per stream")
            print("| streams per engine | tokens/s (both engines) | gap p50 ms | gap p99 ms | gap max ms |")
            print("|---:|---:|---:|---:|---:|")
            for streams in (1, 8):
                started = time.monotonic()
                results = await asyncio.gather(*(_stream(session, engine.url, args.tokens)
                                                 for engine in engines for _ in range(streams)))
                elapsed = time.monotonic() - started
                gaps = [g * 1e3 for _, stream_gaps in results for g in stream_gaps]
                rate = sum(count for count, _ in results) / elapsed
                print(f"| {streams} | {rate:.0f} | {percentile(gaps, 0.5):.1f} "
                      f"| {percentile(gaps, 0.99):.1f} | {max(gaps):.0f} |", flush=True)
    finally:
        await asyncio.gather(*(engine.stop() for engine in engines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-s", type=float, default=SHM_READER_BUSY_S,
                        help="seconds a shm-queue reader spins after a message (vLLM's own: 1)")
    parser.add_argument("--recheck-ms", type=int, default=SHM_READER_RECHECK_MS,
                        help="longest sleep of a parked reader (vLLM's own: 5000)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llumnix-engine-pair-") as tmp:
        asyncio.run(measure(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
