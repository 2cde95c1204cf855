"""P99 time to first token of a bursty trace served through the router by 16 sim engines, per dispatch
policy, in real time (issue #5's acceptance: the llumnix policy beats round-robin).

    .venv/bin/python bench/router_policies_p99.py [--repeats 2] [--policies llumnix,round-robin]

One local service (16 sim engine + llumlet pairs of 64 KV blocks each, migration off) serves the
same trace once per policy and repeat; each policy gets its own router over the same instances, and
the order of the policies alternates between repeats so neither always runs first on fresh
instances. The client is `llumnix bench` in its own process. Prints TTFT mean / P50 / P99 per run and
the median P99 per policy.

The defaults make KV memory, not the CPU, the bottleneck: long prompts with short outputs (L-S,
capped at 600 tokens, so two or three requests fill an instance) at half the profile's speed. With
every token of 16 engines, 16 llumlets, the router and the client on 2 cores (S-S at full speed),
the processes are starved and the comparison measures scheduling delays of the machine instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml

from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router
from llumnix.up import LocalService, router_config

# 64 blocks of 16 tokens: a few long requests fill an instance, so placement matters.
ENGINE_ARGS = ["--num-blocks", "64", "--max-model-len", "1000"]


def manifest(instances: int, time_scale: float) -> dict:
    return {"apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService", "metadata": {"name": "p99"},
            "spec": {"model": {"name": "sim"},
                     "engine": {"runtime": "sim", "blockSize": 16,
                                "args": [*ENGINE_ARGS, "--time-scale", str(time_scale)]},
                     "instances": {"min": instances, "max": instances},
                     "migration": {"enabled": False}}}


async def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the service did not come up")
        await asyncio.sleep(0.2)


async def serve_once(service: LocalService, policy: str, args: argparse.Namespace, out: Path) -> dict:
    # A router of its own over the service's llumlets, presenting the service's token as its own does.
    config = replace(router_config(service.service_file, "127.0.0.1", 0, 1000, dispatch_policy=policy),
                     service_token=service.token)
    router = Router(config, ListInstanceSource(service.source.addresses))
    await router.start()
    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == args.instances, 60)
        # Every instance idle before the run starts.
        await wait_until(lambda: all(i.is_idle() for i in router.instances.dispatchable()), 120)
        # The client runs in its own process: in the router's event loop it would compete with the
        # router for the same core and its delays would count as the router's.
        client = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("llumnix")), "bench", "--url", router.url, "--model", "sim",
            "--trace", args.trace,
            "--requests", str(args.requests), "--rate", str(args.rate), "--cv", str(args.cv),
            "--seed", str(args.seed), "--max-total-tokens", "600", "--json", str(out),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        if await client.wait() != 0:
            raise RuntimeError(f"llumnix bench failed against the {policy} router")
    finally:
        await router.shutdown()
    return json.loads(out.read_text(encoding="utf-8"))


async def main(args: argparse.Namespace) -> None:
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "service.yaml"
        path.write_text(yaml.safe_dump(manifest(args.instances, args.time_scale)), encoding="utf-8")
        service = LocalService(str(path), Path(tmp) / "work", None, port=0, on_event=lambda _: None)
        await service.start()
        try:
            await asyncio.wait_for(service.wait_serving(asyncio.Event()), 240)
            p99s: dict[str, list[float]] = {p: [] for p in policies}
            print("| repeat | policy | TTFT mean s | TTFT P50 s | TTFT P99 s | errors |")
            print("|---:|---|---:|---:|---:|---:|")
            for repeat in range(args.repeats):
                order = policies if repeat % 2 == 0 else policies[::-1]
                for policy in order:
                    summary = await serve_once(service, policy, args, Path(tmp) / f"{policy}-{repeat}.json")
                    p99s[policy].append(float(summary["prefill_p99"]))
                    ttft = " | ".join(f"{summary[f'prefill_{k}']:.3f}" for k in ("mean", "p50", "p99"))
                    print(f"| {repeat} | {policy} | {ttft} | {summary['errors']} |", flush=True)
            print()
            for policy, values in p99s.items():
                print(f"{policy}: median P99 TTFT {statistics.median(values):.3f} s over {len(values)} runs")
        finally:
            await service.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="llumnix,round-robin")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--trace", default="L-S", help="length distribution (see llumnix bench --help)")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="sim engine speed against the profile's real time; below 1 keeps the 2-core "
                        "machine from being the bottleneck")
    parser.add_argument("--cv", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
