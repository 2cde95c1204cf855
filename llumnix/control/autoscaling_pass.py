"""The autoscaling pass: `autoscaling.decide` over the loads moves the target instance count (the
reconcile pass then starts, drains and releases); a scale-down waits for its stabilization window."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from llumnix.control.backend import InstancePhase
from llumnix.control.drains import Drains
from llumnix.control.fleet import Fleet
from llumnix.control.reporting import Reporter
from llumnix.load import ClusterDemand
from llumnix.policies import autoscaling
from llumnix.service_spec import ServiceSettings


class AutoscalingPass:
    def __init__(self, fleet: Fleet, drains: Drains, reporter: Reporter, clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.drains = drains
        self.reporter = reporter
        self.clock = clock
        self.target: int | None = None
        """The instance count autoscaling wants (None: not yet adopted)."""
        self._scale_down_wanted_since: float | None = None
        self._last_demand: ClusterDemand | None = None
        """The previous decision's demand: how fast it rises sets how early, and by how many, to scale up."""

    def adopt_target(self, minimum: int, maximum: int) -> None:
        """Start from the serving count found (instances starting or READY, not draining), within
        the bounds."""
        self.target = sum(1 for i in self.fleet.instances.values()
                          if i.phase in (InstancePhase.STARTING, InstancePhase.READY)
                          and i.instance_id not in self.drains)
        self.keep_within(minimum, maximum)

    def keep_within(self, minimum: int, maximum: int) -> None:
        """The target moves inside the bounds (instances.min, instances.max): the count is never
        outside them, and raising instances.max after lowering it must not bring back the instances
        the lower bound drained."""
        if self.target is not None:
            self.target = min(max(self.target, minimum), maximum)

    async def step(self, settings: ServiceSettings, desired: int,
                   held_tokens: Callable[[], Awaitable[Sequence[int]]] | None = None) -> bool:
        """One decision; True when the caller is to meet the (possibly moved) target now. `desired`:
        the instance count before the decision; `held_tokens()`: the requests the routers hold, read
        only when a decision is made."""
        if self.target is None:
            return False
        held = await held_tokens() if held_tokens is not None else ()
        loads = self.fleet.loads()  # after the read: the loads as fresh as the held requests
        if len(loads) < self.fleet.count(InstancePhase.READY):
            return False  # a READY instance without a load yet: decide on the whole picture only
        config = settings.autoscaling
        action = autoscaling.decide(loads, self.fleet.count(InstancePhase.STARTING), config,
                                    settings.load_model, self._last_demand, held)
        self._last_demand = action.demand
        if action.kind != "drain":
            self._scale_down_wanted_since = None
        if action.kind == "scale-up":
            self.target = min(desired + action.starts, config.max_instances)
            self.reporter.decide("scale-up", action.reason)
        elif action.kind == "cancel-drain" and action.instance_id is not None:
            # The drained instance back, and what the projection needs beyond it.
            self.target = min(desired + 1 + action.starts, config.max_instances)
            self.reporter.decide("cancel-drain", action.reason, action.instance_id)
            self.drains.cancel(action.instance_id, action.reason)
            await self.fleet.push_draining(action.instance_id)
        elif action.kind == "drain" and action.instance_id is not None:
            now = self.clock()
            if self._scale_down_wanted_since is None:
                self._scale_down_wanted_since = now
            if now - self._scale_down_wanted_since >= settings.spec.autoscaling.scale_down_stabilization_s:
                self._scale_down_wanted_since = None
                self.target = max(desired - 1, config.min_instances)
                self.drains.mark(action.instance_id, "scale-down", action.reason)
                await self.fleet.push_draining(action.instance_id)
        else:
            return False
        return True
