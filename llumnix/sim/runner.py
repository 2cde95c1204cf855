"""One simulation run described by plain values (so runs can go to worker processes), and many runs
with a progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tqdm import tqdm

from llumnix.policies.autoscaling import AutoscalingConfig
from llumnix.policies.migration import DEFAULT_MIGRATION, MigrationConfig
from llumnix.profile import DEFAULT_PROFILE, load_profile
from llumnix.sim.cluster import Cluster, Progress
from llumnix.sim.instance import DEFAULT_WATERMARK
from llumnix.sim.metrics import SimResult
from llumnix.sim.systems import SimConfig, system
from llumnix.traces import generate_trace


@dataclass(frozen=True, slots=True)
class RunSpec:
    policy: str
    trace: str = "M-M"
    """A trace preset (S-S, M-M, ..., sharegpt, burstgpt) or a dataset file."""
    rate: float = 7.5
    cv: float = 1.0
    requests: int = 2000
    instances: int = 16
    seed: int = 0
    high_priority_fraction: float = 0.0
    profile: str = DEFAULT_PROFILE
    chunked_prefill_tokens: int = 0
    """Engines' chunked-prefill token budget; 0: prefill-first (the paper's vLLM)."""
    watermark: float = DEFAULT_WATERMARK
    """Share of the blocks engines keep free when admitting a prompt."""
    queue_passing: bool = False
    migration: MigrationConfig = DEFAULT_MIGRATION
    """The migration rule of the systems that migrate (sources, destinations, the request moved)."""
    autoscaling: AutoscalingConfig | None = None
    label: str = ""
    """What the run stands for in a report (e.g. the swept value)."""


def simulate(spec: RunSpec, progress: Progress | None = None) -> SimResult:
    profile = load_profile(spec.profile)
    trace = generate_trace(
        spec.trace,
        spec.requests,
        spec.rate,
        cv=spec.cv,
        seed=spec.seed,
        high_priority_fraction=spec.high_priority_fraction,
    )
    config = SimConfig(autoscaling=spec.autoscaling, chunked_prefill_tokens=spec.chunked_prefill_tokens,
                       watermark=spec.watermark, queue_passing=spec.queue_passing, migration=spec.migration)
    cluster = Cluster(trace, system(spec.policy), profile, spec.instances, config, seed=spec.seed)
    return cluster.run(progress)


def simulate_with_bar(spec: RunSpec, description: str) -> SimResult:
    """One run with a progress bar over virtual time (up to the last arrival)."""
    with tqdm(total=spec.requests, desc=description, unit="req", leave=False) as bar:

        def progress(_now: float, finished: int) -> None:
            bar.update(finished - bar.n)

        return simulate(spec, progress)


def simulate_many(specs: Sequence[RunSpec], jobs: int = 1, description: str = "runs") -> list[SimResult]:
    """Every run, in order; `jobs` > 1 spreads them over worker processes."""
    results: list[SimResult | None] = [None] * len(specs)
    with tqdm(total=len(specs), desc=description, unit="run") as bar:
        if jobs <= 1:
            for i, spec in enumerate(specs):
                results[i] = simulate(spec)
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(simulate, spec): i for i, spec in enumerate(specs)}
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update()
    return [r for r in results if r is not None]
