"""The serving systems the simulator compares, and its one default configuration.

A system is a dispatch policy plus whether it migrates and whether it honours priorities; every
decision it makes comes from `llumnix.policies`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llumnix.load import DEFAULT_LOAD_MODEL, LoadModelConfig
from llumnix.policies.autoscaling import AutoscalingConfig
from llumnix.policies.dispatch import DEFAULT_PREFIX_WEIGHT
from llumnix.policies.migration import MigrationConfig
from llumnix.sim.instance import DEFAULT_WATERMARK


@dataclass(frozen=True, slots=True)
class SystemSpec:
    name: str
    dispatch: str
    """A `llumnix.policies.dispatch` policy name."""
    migration: bool
    priorities: bool
    """Whether high-priority requests are scheduled as such (otherwise all are normal)."""
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    """Prefix-cache awareness of the dispatch policy (`make_dispatch_policy`); 0: freeness only."""
    holds: bool = False
    """Whether a request that finds every instance busy waits in the router's queue until one frees
    room (`llumnix.policies.dispatch.placement`, as the product's router does) rather than in the
    queue of the instance the policy chose (the baselines)."""


SYSTEMS: dict[str, SystemSpec] = {
    "llumnix": SystemSpec("llumnix", "llumnix", migration=True, priorities=True, holds=True),
    "llumnix-base": SystemSpec("llumnix-base", "llumnix", migration=True, priorities=False, holds=True),
    "infaas++": SystemSpec("infaas++", "infaas++", migration=False, priorities=False),
    # Ablations: each of Llumnix's two mechanisms without the other.
    "llumnix-nomig": SystemSpec("llumnix-nomig", "llumnix", migration=False, priorities=True, holds=True),
    "llumnix-noprefix": SystemSpec("llumnix-noprefix", "llumnix", migration=True, priorities=True,
                                   prefix_weight=0.0, holds=True),
    "infaas++-mig": SystemSpec("infaas++-mig", "infaas++", migration=True, priorities=False),
    # Llumnix with a burst's overflow queued at the instances rather than held by the router.
    "llumnix-nohold": SystemSpec("llumnix-nohold", "llumnix", migration=True, priorities=True),
    "round-robin": SystemSpec("round-robin", "round-robin", migration=False, priorities=False),
    "least-requests": SystemSpec("least-requests", "least-requests", migration=False, priorities=False),
}


def system(name: str) -> SystemSpec:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(SYSTEMS)}") from None


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything but the trace, the system and the instance count. The defaults are the single
    configuration every preset and experiment uses (docs/simulator.md)."""

    migration: MigrationConfig = field(default_factory=MigrationConfig)
    migration_interval_s: float = 0.1
    """Migration pairing period (ARCHITECTURE.md: intervalMs 100); fragmentation is sampled with it."""
    max_migration_stages: int = 8
    """Stage bound: the stage after this many copies is the final one whatever the delta."""
    autoscaling: AutoscalingConfig | None = None
    """None: a fixed number of instances."""
    scale_down_stabilization_s: float = 30.0
    """A drain starts only once scale-down has been wanted this long, as the operator's control loop
    does (`autoscaling.scaleDownStabilizationSeconds`, default 30 s)."""
    chunked_prefill_tokens: int = 0
    """Engines chunk prefills into iterations of this many tokens (`EngineConfig`); 0: prefill-first."""
    queue_passing: bool = False
    """Engines admit a queued request that fits past one that does not (`EngineConfig.queue_passing`)."""
    prefix_caching: bool = True
    """Instances keep a prefix cache (vLLM's default). Only traces with shared content hit it."""
    watermark: float = DEFAULT_WATERMARK
    """Share of the blocks engines keep free when admitting a prompt (`EngineConfig.watermark`)."""
    load_model: LoadModelConfig = DEFAULT_LOAD_MODEL
    dispatch_top_k: int = 1
