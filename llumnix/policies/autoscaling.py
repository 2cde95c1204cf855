"""Autoscaling policy: the cluster's aggregate freeness against two bounds.

- Below `scale_up_below`, now or one start-up delay ahead at the rate it fell over the last
  interval: start one instance (up to `max_instances`). Instances still starting count with their
  empty capacity: another one starts only while the cluster would still be below the bound with them
  serving, so a slow start-up neither triggers a stampede nor, as a rule of
  one start-up at a time did, holds a growing backlog to one new instance per start-up delay.
- Above `scale_down_above` even with one instance's capacity removed: pick the freest instance
  (ties: fewest requests), mark it draining; migration empties it.
- A drained instance, once empty, is parked: kept for `park_s` before it is released
  (`release_due`). A drain is cancelled (the instance serves again, at once) if load rises so that
  the cluster without it would need to scale up; a parked instance is the first one reused
  (`reuse_order`), so a burst soon after a scale-down gets back an instance that serves now
  instead of one that serves a start-up delay later. While one is parked, no other drains.

`decide` is pure: the caller keeps the instance list and applies the returned action.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from llumnix.load import DEFAULT_LOAD_MODEL, InstanceLoad, LoadModelConfig, aggregate_freeness, freeness


@dataclass(frozen=True, slots=True)
class AutoscalingConfig:
    scale_up_below: float = 10.0
    scale_down_above: float = 60.0
    min_instances: int = 1
    max_instances: int = 16
    interval_s: float = 10.0
    startup_delay_s: float = 30.0
    """Time from starting an instance until it serves: the simulator's model, and how far ahead a
    falling aggregate freeness is projected (the control loop uses `startupGraceSeconds`)."""
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


def _short_with_starting(
    serving: Sequence[InstanceLoad], starting: int, config: AutoscalingConfig, model: LoadModelConfig
) -> bool:
    """Whether the cluster stays below the lower bound once the `starting` instances serve (each
    as large as the serving ones on average; with none serving, one start-up at a time)."""
    if starting == 0:
        return True
    if not serving:
        return False
    per_instance = sum(load.total_blocks for load in serving) // len(serving)
    return aggregate_freeness(serving, model, added_blocks=starting * per_instance) < config.scale_up_below


def projected_freeness(
    aggregate: float, previous_aggregate: float | None, config: AutoscalingConfig
) -> float:
    """The aggregate freeness one start-up delay ahead, if it keeps falling as it did over the last
    decision interval (never above the current value: a rise does not postpone a scale-up).

    Only within the bounds: above `scale_down_above` the cluster is far from short, and freeness
    (headroom divided by a small batch) swings by hundreds as a few requests come and go there."""
    if previous_aggregate is None or aggregate >= previous_aggregate or aggregate > config.scale_down_above:
        return aggregate
    slope = (aggregate - previous_aggregate) / config.interval_s
    return aggregate + slope * config.startup_delay_s


def decide(
    loads: Sequence[InstanceLoad],
    starting: int,
    config: AutoscalingConfig = AutoscalingConfig(),
    model: LoadModelConfig = DEFAULT_LOAD_MODEL,
    previous_aggregate: float | None = None,
) -> ScalingAction:
    """One autoscaling step over the serving and draining instances plus `starting` ones.

    `previous_aggregate` is the aggregate freeness of the previous decision (its action's
    `aggregate_freeness`): a falling aggregate scales up once it would cross the lower bound within
    one start-up delay, so the new instance serves when the cluster gets short, not a start-up delay
    after."""
    serving = [load for load in loads if not load.draining]
    reuse = reuse_order(loads, model)
    # One drain at a time, parking included: a parked instance is the capacity a burst gets back
    # at once, and draining a second one while it waits would shrink the cluster twice as fast
    # (measured on Fig. 14: docs/reproduction.md, "Parking drained instances").
    draining = bool(reuse)
    agg = aggregate_freeness(serving, model)
    ahead = projected_freeness(agg, previous_aggregate, config)

    if len(serving) + starting < config.min_instances:
        below = f"fewer than min_instances={config.min_instances}"
        if reuse:
            return ScalingAction("cancel-drain", reuse[0], below, agg)
        return ScalingAction("scale-up", None, below, agg)
    if ahead < config.scale_up_below:
        falling = f"aggregate freeness {agg:.1f}, {ahead:.1f} one start-up ahead"
        if reuse:
            return ScalingAction("cancel-drain", reuse[0], f"{falling}, fell again", agg)
        room = len(serving) + starting < config.max_instances
        if room and _short_with_starting(serving, starting, config, model):
            return ScalingAction("scale-up", None, f"{falling} < {config.scale_up_below}", agg)
        return ScalingAction("none", None, "scale-up pending or at max_instances", agg)
    if not draining and starting == 0 and len(serving) > max(1, config.min_instances):
        victim = drain_candidate(serving, model)
        assert victim is not None
        without = aggregate_freeness(serving, model, exclude_capacity_of=victim)
        if without > config.scale_down_above:
            reason = f"aggregate freeness {without:.1f} without it > {config.scale_down_above}"
            return ScalingAction("drain", victim, reason, agg)
    return ScalingAction("none", None, "", agg)
