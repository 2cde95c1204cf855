"""The reconcile pass's steps: replace failed instances (and those not READY within the start-up
grace), release drained ones once empty, then start or drain instances until the serving count
meets the desired count. The loop sequences them; `autoscaling.drain_candidate` picks what to drain."""

from __future__ import annotations

from collections.abc import Callable

from llumnix.control.backend import InstanceInfo, InstancePhase
from llumnix.control.drains import Drains
from llumnix.control.fleet import Fleet
from llumnix.control.replacement import ReplacementBackoff
from llumnix.control.reporting import Reporter
from llumnix.load import LoadModelConfig
from llumnix.policies import autoscaling


class Reconciler:
    def __init__(self, fleet: Fleet, drains: Drains, backoff: ReplacementBackoff, reporter: Reporter,
                 clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.drains = drains
        self.backoff = backoff
        self.reporter = reporter
        self.clock = clock
        self.scale_ups = 0

    async def replace_unhealthy(self, listed: list[InstanceInfo], now: float, grace_s: float) -> None:
        for info in listed:
            if info.phase is InstancePhase.FAILED:
                await self._replace(info, f"instance failed: {info.message or 'no reason given'}")
            elif info.phase is InstancePhase.STARTING and now - info.created_at > grace_s:
                await self._replace(info, f"not ready {grace_s:.0f} s after it was created")

    async def _replace(self, info: InstanceInfo, why: str) -> None:
        self.reporter.event("Warning", "InstanceFailed", f"{why}; replacing it", info.instance_id)
        self.reporter.decide("replace", why, info.instance_id)
        self.backoff.failed(self.clock())
        self.drains.forget(info.instance_id)
        await self.fleet.stop(info.instance_id)

    async def release_drained(self, now: float, migrating: Callable[[str], bool], timeout_s: float,
                              park_s: float) -> None:
        """Push each READY draining instance's flag; stop those whose drain is done (`park_s`: how
        long an emptied scale-down drain is parked first). `migrating(id)`: a MigrateOut from it is
        in flight."""
        for instance_id in list(self.drains):
            info = self.fleet.instances.get(instance_id)
            if info is None or info.phase is not InstancePhase.READY:
                continue
            await self.fleet.push_draining(instance_id)
            if self.drains.release_due(instance_id, self.fleet.load(instance_id), migrating(instance_id),
                                       now, timeout_s, park_s):
                await self.fleet.stop(instance_id)

    def _reuse_order(self, instance_ids: list[str], load_model: LoadModelConfig) -> list[str]:
        """Drains in the order a scale-up puts them back (`autoscaling.reuse_order`: parked, empty
        ones first); those without a load last."""
        loads = [load for load in self.fleet.loads() if load.instance_id in instance_ids]
        order = autoscaling.reuse_order(loads, load_model)
        return order + [i for i in instance_ids if i not in order]

    async def meet_target(self, desired: int, load_model: LoadModelConfig) -> None:
        """Start instances (cancelling scale-down drains first) or remove surplus ones until
        `desired` serve."""
        live = [i for i in self.fleet.instances.values()
                if i.phase in (InstancePhase.STARTING, InstancePhase.READY)]
        serving = [i for i in live if i.instance_id not in self.drains]
        shortfall = desired - len(serving)
        if shortfall > 0:
            for instance_id in self._reuse_order(self.drains.cancellable(), load_model)[:shortfall]:
                self.drains.cancel(instance_id, "instances are needed again")
                await self.fleet.push_draining(instance_id)
                shortfall -= 1
            for _ in range(shortfall):
                if self.backoff.holding(self.clock()):
                    break  # backing off after repeated failures
                info = await self.fleet.start()
                serving.append(info)
                if self.backoff.successor_started():
                    self.reporter.event("Normal", "Replaced", "started a successor for a failed instance",
                                        info.instance_id)
                else:
                    self.scale_ups += 1
                    self.reporter.event("Normal", "ScaledUp", f"started an instance ({len(serving)} of "
                                        f"{desired})", info.instance_id)
        else:
            self.backoff.no_successor_needed()
        if shortfall < 0:
            # Surplus: instances still starting hold no requests, stop those first; then drain.
            starting = sorted((i for i in serving if i.phase is InstancePhase.STARTING),
                              key=lambda i: -i.created_at)
            for info in starting[:-shortfall]:
                self.reporter.event("Normal", "ScaledDown", "surplus instance stopped before it served",
                                    info.instance_id)
                await self.fleet.stop(info.instance_id)
                shortfall += 1
            loads = [load for load in self.fleet.loads() if not load.draining]
            while shortfall < 0 and loads:
                victim = autoscaling.drain_candidate(loads, load_model)
                assert victim is not None
                self.drains.mark(victim, "scale-down", f"more instances than the {desired} desired")
                await self.fleet.push_draining(victim)
                loads = [load for load in loads if load.instance_id != victim]
                shortfall += 1
