"""Metrics of one simulated run (paper §6.1): latencies, preemption loss, fragmentation, cost.

- prefill latency: first token - arrival; decode latency: mean time per generated token after the
  first (requests with one output token have none); end-to-end: finish - arrival. Mean and P99
  (prefill also its maximum and its tail mean: the mean of the slowest 1%).
- preemption loss: time between a preemption and the end of the recompute that resumes the request
  (extra queuing plus recompute), summed per request and averaged over all requests.
- fragmentation (§6.3): at each sample, the part of the cluster's free memory that could serve the
  instances' memory-blocked head-of-line requests if memory were not split across instances (the
  smallest demands first), as a fraction of the cluster's total memory.
- average instances: time-weighted count of instances that exist (starting and draining ones
  included), from the first arrival's time origin to the last finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llumnix.sim.request import SimRequest

LATENCY_KEYS = (
    "prefill_mean",
    "prefill_p99",
    "prefill_max",
    "prefill_tail_mean",
    "decode_mean",
    "decode_p99",
    "e2e_mean",
    "e2e_p99",
    "preemption_loss",
)
"""What `latency_summary` gives for a selection of requests (with `finished`)."""
SUMMARY_KEYS = (*LATENCY_KEYS, "fragmentation_mean", "avg_instances", "migrations", "finished")


def fragmented_blocks(free_blocks: int, blocked_demands: Sequence[int]) -> int:
    """Blocks of `free_blocks` (the cluster's free memory) that could serve the blocked head-of-line
    demands, smallest first, if they were in one place: 8 free, demands 3, 3, 3 -> 6."""
    served = 0
    for demand in sorted(blocked_demands):
        if served + demand > free_blocks:
            break
        served += demand
    return served


@dataclass
class SimResult:
    system: str
    requests: list[SimRequest]
    duration: float
    """Virtual seconds until the last request finished."""
    avg_instances: float
    fragmentation_times: list[float] = field(default_factory=list)
    fragmentation: list[float] = field(default_factory=list)
    instance_times: list[float] = field(default_factory=list)
    instance_counts: list[int] = field(default_factory=list)
    migration_downtimes: list[float] = field(default_factory=list)
    migrations_aborted: int = 0
    migration_stages: list[int] = field(default_factory=list)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens whose prefill a prefix-cache hit saved."""
    events: int = 0
    wall_seconds: float = 0.0

    def summary(self) -> dict[str, float | int]:
        """The run's headline numbers (seconds for times); keys SUMMARY_KEYS and a few more."""
        stats: dict[str, float | int] = dict(latency_summary(self.requests))
        stats["fragmentation_mean"] = float(np.mean(self.fragmentation)) if self.fragmentation else 0.0
        stats["avg_instances"] = self.avg_instances
        stats["migrations"] = len(self.migration_downtimes)
        stats["migrations_aborted"] = self.migrations_aborted
        downtimes = np.asarray(self.migration_downtimes)
        stats["downtime_mean"] = float(downtimes.mean()) if downtimes.size else 0.0
        stats["downtime_p99"] = float(np.percentile(downtimes, 99)) if downtimes.size else 0.0
        stats["migration_stages_mean"] = (
            float(np.mean(self.migration_stages)) if self.migration_stages else 0.0
        )
        stats["preemptions"] = self.preemptions
        prompt_tokens = sum(r.prompt_tokens for r in self.requests)
        stats["prefix_hit_rate"] = self.prefix_hit_tokens / prompt_tokens if prompt_tokens else 0.0
        stats["duration"] = self.duration
        return stats


TAIL_FRACTION = 0.01
"""The share of requests, the slowest, whose mean prefill is the tail mean: what the P99 cuts off,
weighed rather than picked at one rank."""


def latency_summary(requests: Sequence[SimRequest]) -> dict[str, float | int]:
    """Latency statistics over finished requests (an empty selection gives zeros)."""
    done = [r for r in requests if r.finish_time >= 0]
    if not done:
        return dict.fromkeys(LATENCY_KEYS, 0.0) | {"finished": 0}
    arrival = np.array([r.arrival_time for r in done])
    first = np.array([r.first_token_time for r in done])
    finish = np.array([r.finish_time for r in done])
    outputs = np.array([r.output_tokens for r in done])
    prefill = first - arrival
    e2e = finish - arrival
    multi = outputs > 1
    decode = (finish[multi] - first[multi]) / (outputs[multi] - 1)
    slowest = np.sort(prefill)[-max(1, round(TAIL_FRACTION * len(prefill))):]
    return {
        "prefill_mean": float(prefill.mean()),
        "prefill_p99": float(np.percentile(prefill, 99)),
        "prefill_max": float(prefill.max()),
        "prefill_tail_mean": float(slowest.mean()),
        "decode_mean": float(decode.mean()) if decode.size else 0.0,
        "decode_p99": float(np.percentile(decode, 99)) if decode.size else 0.0,
        "e2e_mean": float(e2e.mean()),
        "e2e_p99": float(np.percentile(e2e, 99)),
        "preemption_loss": float(np.mean([r.preemption_loss for r in done])),
        "finished": len(done),
    }


def class_summaries(result: SimResult) -> dict[str, dict[str, float | int]]:
    """Latency statistics of the trace's high-priority and normal requests separately."""
    high = [r for r in result.requests if r.trace_high_priority]
    normal = [r for r in result.requests if not r.trace_high_priority]
    return {"high": latency_summary(high), "normal": latency_summary(normal)}


MISPLACED_BLOCKS = 32
"""A request is misplaced when another instance had at least this many more blocks of its prompt
cached than the one it was sent to (32 blocks of 16 tokens: 512 tokens, ~0.08 s of prefill)."""


def prefix_dispatch_stats(
    requests: Sequence[SimRequest], block_size: int, iteration_time: Callable[[int, int, int, int], float]
) -> dict[str, float]:
    """Where the P99 prefill latency of a shared-prefix run comes from.

    - `floor_p99`: the P99 over requests of the prefill each would take alone on an idle instance that
      had the most of its prompt cached at its dispatch (no instance could serve it faster then; the
      cache contents themselves depend on the run's earlier choices).
    - `misplaced`: share of requests sent where at least MISPLACED_BLOCKS fewer blocks of the prompt
      were cached than on the best holder; `tail_misplaced`: the same among the requests at or above
      the P99 prefill latency; `tail_queued`: share of those that waited longer than their own
      uncached prefill would take alone (queueing rather than compute made them slow)."""
    done = [r for r in requests if r.first_token_time >= 0]
    if not done:
        return {"floor_p99": 0.0, "misplaced": 0.0, "tail_misplaced": 0.0, "tail_queued": 0.0}

    def alone(request: SimRequest, cached_blocks: int) -> float:
        cached = min(cached_blocks * block_size, request.prompt_tokens - 1)
        tokens = request.prompt_tokens - cached
        return iteration_time(tokens, 0, 0, tokens * (2 * cached + tokens))

    floor = np.array([alone(r, r.best_cached_blocks) for r in done])
    prefill = np.array([r.first_token_time - r.arrival_time for r in done])
    misplaced = np.array(
        [r.best_cached_blocks - r.dispatched_cached_blocks >= MISPLACED_BLOCKS for r in done]
    )
    own = np.array([alone(r, r.dispatched_cached_blocks) for r in done])
    tail = prefill >= np.percentile(prefill, 99)
    return {
        "floor_p99": float(np.percentile(floor, 99)),
        "misplaced": float(misplaced.mean()),
        "tail_misplaced": float(misplaced[tail].mean()),
        "tail_queued": float((prefill[tail] - own[tail] > own[tail]).mean()),
    }
