"""The main job on the embedded default: a short, bursty workload on a small simulated cluster,
served by Llumnix's policies and by two baselines, with a printed summary.

It runs the discrete-event simulator (`llumnix simulate`) with the bundled LLaMA-7B/A10 latency
profile: four instances, a bursty (Gamma, CV 3) trace of medium-length requests. Once local mode
(`llumnix up`) lands, this command starts real engines instead.
"""

from __future__ import annotations

import argparse

from llumnix.sim.cli import format_table
from llumnix.sim.runner import RunSpec, simulate_with_bar

DEMO_POLICIES = ("llumnix", "infaas++", "round-robin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=600, help="requests in the workload (default 600)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.requests < 1:
        print("llumnix demo: --requests must be at least 1")
        return 2
    print(
        f"Simulating 4 LLaMA-7B instances on A10 GPUs under {args.requests} bursty M-M requests "
        "(3 req/s, CV 3)...\n"
    )
    results = {}
    for policy in DEMO_POLICIES:
        spec = RunSpec(
            policy=policy, trace="M-M", rate=3.0, cv=3.0, requests=args.requests, instances=4, seed=args.seed
        )
        results[policy] = simulate_with_bar(spec, policy).summary()
    print(format_table(results))
    best = min(results, key=lambda p: results[p]["prefill_p99"])
    print(
        f"\nLowest P99 time to first token: {best}. "
        "Reproduce the paper's figures with `llumnix simulate --experiment fig11 --out DIR`."
    )
    return 0
