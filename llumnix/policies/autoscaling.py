"""Autoscaling policy: the cluster's aggregate freeness against two bounds.

- Below `scale_up_below`, now or one start-up delay ahead: start as many instances as it takes for
  the cluster to reach the bound once they serve (up to `max_instances`). "Ahead" projects the
  cluster's demand (`llumnix.load.ClusterDemand`: the KV blocks its requests hold or wait for, and
  how many requests), not its freeness: blocks rising over the last interval are assumed to keep
  rising as fast for one start-up delay (`projected_demand`). Instances still starting count with
  their empty capacity, so a slow start-up neither triggers a stampede nor holds a growing backlog
  to one new instance per start-up delay.
- Above `scale_down_above` even with one instance's capacity removed: pick the freest instance
  (ties: fewest requests), mark it draining; migration empties it.
- A drained instance, once empty, is parked: kept for `park_s` before it is released
  (`release_due`). A drain is cancelled (the instance serves again, at once) if load rises so that
  the cluster without it would need to scale up; a parked instance is the first one reused
  (`reuse_order`), so a burst soon after a scale-down gets back an instance that serves now
  instead of one that serves a start-up delay later; what the burst needs beyond it starts in the
  same decision. While one is parked, no other drains.

`decide` is pure: the caller keeps the instance list and the previous decision's demand, and applies
the returned action.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    ClusterDemand,
    InstanceLoad,
    LoadModelConfig,
    cluster_demand,
    freeness,
)


@dataclass(frozen=True, slots=True)
class AutoscalingConfig:
    scale_up_below: float = 10.0
    scale_down_above: float = 60.0
    min_instances: int = 1
    max_instances: int = 16
    interval_s: float = 10.0
    startup_delay_s: float = 30.0
    """Time from starting an instance until it serves: the simulator's model, and how far ahead
    rising demand is projected (the control loop uses `startupGraceSeconds`)."""
    park_s: float = 60.0
    """How long a drained, empty instance is kept before it is released (0: released at once)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_instances <= self.max_instances:
            raise ValueError("need 0 <= min_instances <= max_instances")
        if self.scale_up_below >= self.scale_down_above:
            raise ValueError("scale_up_below must be lower than scale_down_above")
        if self.park_s < 0:
            raise ValueError("park_s must not be negative")


@dataclass(frozen=True, slots=True)
class ScalingAction:
    kind: str
    """'scale-up', 'drain', 'cancel-drain' or 'none' (releases: `release_due`)."""
    instance_id: str | None = None
    reason: str = ""
    aggregate_freeness: float = 0.0
    starts: int = 0
    """Instances to start: a scale-up's (at least one), or those a cancel-drain starts besides the
    instance it puts back (what the projection needs beyond it)."""
    demand: ClusterDemand = field(default_factory=ClusterDemand)
    """The serving instances' demand when decided: the next decision's `previous`."""


def drain_candidate(loads: Sequence[InstanceLoad], model: LoadModelConfig = DEFAULT_LOAD_MODEL) -> str | None:
    """The instance cheapest to remove: the freest, then the one with fewest requests."""
    serving = [load for load in loads if not load.draining]
    if not serving:
        return None
    best = max(serving, key=lambda load: (freeness(load, model), -load.num_requests, load.instance_id))
    return best.instance_id


def drained_empty(load: InstanceLoad) -> bool:
    """A draining instance with nothing left on it: no request and no migration either way (an
    aborted final stage hands its request back to the source)."""
    return load.draining and load.num_requests == 0 and load.migrating_out == 0 and load.migrating_in == 0


def release_due(empty_since: float | None, now: float, park_s: float) -> bool:
    """Whether a drained instance, empty since `empty_since` (None: not empty), is released now:
    once it has been parked for `park_s`."""
    return empty_since is not None and now - empty_since >= park_s


def reuse_order(loads: Sequence[InstanceLoad], model: LoadModelConfig = DEFAULT_LOAD_MODEL) -> list[str]:
    """The draining instances in the order a scale-up puts them back: the freest as if serving first
    (a parked, empty one is the freest), then by id. (`freeness` of a draining load is -inf.)"""
    draining = sorted((load for load in loads if load.draining),
                      key=lambda load: (-freeness(replace(load, draining=False), model), load.instance_id))
    return [load.instance_id for load in draining]


def projected_demand(demand: ClusterDemand, previous: ClusterDemand | None, config: AutoscalingConfig
                     ) -> ClusterDemand:
    """The demand one start-up delay ahead if its blocks keep rising as they rose since the previous
    decision (`previous`; None: no projection). A fall projects nothing (finishing requests do not
    postpone a scale-up); the request count is not extrapolated (measured: it cost instances and
    tail latency on Fig. 14, docs/reproduction.md).

    Demand, not freeness: a burst's requests arrive faster than instances start, and what they will
    need is the rise in blocks, whichever instances take them. The freeness projection this replaced
    (issue #18) read the same load as freer on a system that queues less, and it started at most one
    instance per decision."""
    if previous is None or demand.blocks <= previous.blocks:
        return demand
    steps = config.startup_delay_s / config.interval_s
    return ClusterDemand(demand.blocks + steps * (demand.blocks - previous.blocks), demand.requests)


def instances_short(demand: ClusterDemand, capacity: float, serving: int, starting: int,
                    config: AutoscalingConfig) -> int:
    """Instances to start, beyond the `starting` ones, for `demand` to leave the `serving` instances'
    `capacity` (blocks) plus the new ones at least at `scale_up_below` (each new one as large as the
    serving ones on average; with none serving, one start-up at a time). 0 or less: enough serves or
    is on its way."""
    if not serving:
        return 1 - starting
    wanted = config.scale_up_below * max(1, demand.requests) + demand.blocks
    return math.ceil((wanted - capacity) / (capacity // serving)) - starting


def decide(
    loads: Sequence[InstanceLoad],
    starting: int,
    config: AutoscalingConfig = AutoscalingConfig(),
    model: LoadModelConfig = DEFAULT_LOAD_MODEL,
    previous: ClusterDemand | None = None,
    held_tokens: Collection[int] = (),
) -> ScalingAction:
    """One autoscaling step over the serving and draining instances plus `starting` ones, and the
    requests the routers hold (`held_tokens`, `cluster_demand`'s).

    `previous` is the demand of the previous decision (its action's `demand`): rising demand is
    projected one start-up delay ahead, and a scale-up starts enough instances for the projection,
    so they serve when the load arrives, not a start-up delay after. Above `scale_down_above` the
    cluster is far from short and nothing is projected."""
    serving = [load for load in loads if not load.draining]
    reuse = reuse_order(loads, model)
    # One drain at a time, parking included: a parked instance is the capacity a burst gets back
    # at once, and draining a second one while it waits would shrink the cluster twice as fast
    # (measured on Fig. 14: docs/reproduction.md, "Parking drained instances").
    draining = bool(reuse)
    demand = cluster_demand(serving, model, held_tokens)
    capacity = sum(load.total_blocks for load in serving)
    agg = demand.freeness(capacity)
    ahead = projected_demand(demand, previous, config) if agg <= config.scale_down_above else demand
    ahead_agg = ahead.freeness(capacity)

    if len(serving) + starting < config.min_instances:
        below = f"fewer than min_instances={config.min_instances}"
        if reuse:
            return ScalingAction("cancel-drain", reuse[0], below, agg, demand=demand)
        return ScalingAction("scale-up", None, below, agg, starts=1, demand=demand)
    if ahead_agg < config.scale_up_below:
        falling = f"aggregate freeness {agg:.1f}, {ahead_agg:.1f} one start-up ahead"
        if held_tokens:
            falling += f" ({len(held_tokens)} requests held by the routers)"
        short = min(instances_short(ahead, capacity, len(serving), starting, config),
                    config.max_instances - len(serving) - starting)
        if reuse:
            # The drained instance serves again at once; what the projection needs beyond it starts
            # in the same decision, not one interval later (measured on Fig. 14: a burst met with the
            # parked instance alone found the cluster one or more instances short).
            return ScalingAction("cancel-drain", reuse[0], f"{falling}, fell again", agg,
                                 starts=max(0, short - 1), demand=demand)
        if short > 0:
            reason = f"{falling} < {config.scale_up_below}: {short} more"
            return ScalingAction("scale-up", None, reason, agg, starts=short, demand=demand)
        return ScalingAction("none", None, "scale-up pending or at max_instances", agg, demand=demand)
    if not draining and starting == 0 and len(serving) > max(1, config.min_instances):
        victim = drain_candidate(serving, model)
        assert victim is not None
        by_id = {load.instance_id: load for load in serving}
        without = demand.freeness(capacity - by_id[victim].total_blocks)  # its requests stay
        if without > config.scale_down_above:
            reason = f"aggregate freeness {without:.1f} without it > {config.scale_down_above}"
            return ScalingAction("drain", victim, reason, agg, demand=demand)
    return ScalingAction("none", None, "", agg, demand=demand)
