"""The per-service control loop, shared by local mode (`llumnix up`) and the operator.

Level-based: every pass compares what the service should be (settings, the autoscaler's target)
with what the backend and the llumlets' load streams say it is, and acts on the difference, so a
restarted loop over the same instances adopts them and changes nothing. Each pass:

1. reconcile (every `reconcile_interval_s`): list instances and follow the READY ones' load streams
   (`fleet`); stop and replace FAILED ones and those not READY within the start-up grace, release
   drained instances once empty (or after the drain timeout), start or drain instances until the
   serving count meets the target (`reconcile`, `drains`, `replacement`).
2. migrate (every migration interval): `pair_migrations` over the loads with the routers' held requests
   queued where they would go (`with_held_requests`), and `MigrateOut` (`migration_pass`).
3. autoscale (every autoscaling interval, when enabled): `autoscaling.decide` moves the target
   (`autoscaling_pass`).

Who owns the instance count: with autoscaling off, `settings.desired_instances` (the CR's
replicas); with it on, the loop (its target starts at the serving count it finds).

`ControlLoop` owns these parts and sequences them; the policies they apply are the pure functions
of `llumnix.policies`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from llumnix.control.autoscaling_pass import AutoscalingPass
from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.control.drains import Drain, Drains
from llumnix.control.fleet import Fleet, LlumletHandle
from llumnix.control.migration_pass import MigrationPass, migrate_request
from llumnix.control.reconcile import Reconciler
from llumnix.control.replacement import ReplacementBackoff
from llumnix.control.reporting import Reporter
from llumnix.control.router_queues import RouterQueues
from llumnix.control.status import ControlEvent, InstanceStatus, ServiceStatus
from llumnix.llumlet_client import LlumletConnection
from llumnix.load import aggregate_freeness, freeness
from llumnix.policies.migration import held_requests_apply, with_held_requests
from llumnix.service_spec import ServiceSettings
from llumnix.v1 import migration_pb2 as mpb

logger = logging.getLogger("llumnix.control")


class ControlLoop:
    def __init__(self, settings: ServiceSettings, backend: InstanceBackend, *,
                 on_event: Callable[[ControlEvent], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 connect: Callable[[str], LlumletHandle] = LlumletConnection,
                 on_addresses: Callable[[frozenset[str]], None] | None = None,
                 router_queues: RouterQueues | None = None,
                 reconcile_interval_s: float = 1.0,
                 drain_timeout_s: float = 600.0) -> None:
        """`connect(address)` makes a llumlet connection (not started); `on_addresses` receives the
        READY instances' llumlet addresses whenever they change (local mode's router follows it);
        `router_queues`: the service's routers, whose held requests the autoscaler and the migration pass
        count."""
        self.settings = settings
        self.clock = clock
        self.reconcile_interval_s = reconcile_interval_s
        self.drain_timeout_s = drain_timeout_s
        self._reporter = Reporter(on_event, clock, self._aggregate_freeness)
        self._drains = Drains(self._reporter, clock)
        self._fleet = Fleet(backend, connect, on_addresses, self._drains)
        self._backoff = ReplacementBackoff()
        self._reconciler = Reconciler(self._fleet, self._drains, self._backoff, self._reporter, clock)
        self._migrations = MigrationPass(self._fleet)
        self._autoscaling = AutoscalingPass(self._fleet, self._drains, self._reporter, clock)
        self._router_queues = router_queues

    # ---- public API ---------------------------------------------------------------------------

    def update_settings(self, settings: ServiceSettings) -> None:
        """A spec change (including replicas from /scale): acted on at the next reconcile."""
        self.settings = settings
        self._autoscaling.keep_within(settings.spec.instances.min, settings.spec.instances.max)

    @property
    def desired(self) -> int:
        spec = self.settings.spec
        target = self._autoscaling.target
        count = target if spec.autoscaling.enabled and target is not None else self.settings.desired_instances
        return min(max(count, spec.instances.min), spec.instances.max)

    @property
    def target(self) -> int | None:
        """Autoscaling's instance count (None: not yet adopted)."""
        return self._autoscaling.target

    @property
    def instances(self) -> Mapping[str, InstanceInfo]:
        return self._fleet.instances

    @property
    def draining(self) -> Mapping[str, Drain]:
        return self._drains

    @property
    def migration_outcomes(self) -> Mapping[str, int]:
        return self._migrations.outcomes

    @property
    def releases(self) -> int:
        return self._drains.releases

    @property
    def replacements(self) -> int:
        return self._backoff.replacements

    async def run(self) -> None:
        """Until cancelled; the loop's own errors are logged, never fatal."""
        next_reconcile = next_autoscale = 0.0
        try:
            while True:
                now = time.monotonic()
                try:
                    if now >= next_reconcile:
                        await self.reconcile()
                        next_reconcile = now + self.reconcile_interval_s
                    if self.settings.spec.migration.enabled:
                        await self.migrate_pass()
                    if self.settings.spec.autoscaling.enabled and now >= next_autoscale:
                        await self.autoscale()
                        next_autoscale = now + self.settings.spec.autoscaling.interval_s
                except Exception:  # a backend hiccup must not end the loop
                    logger.exception("control loop pass failed")
                await asyncio.sleep(self._sleep_s())
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel migrations in flight (the llumlets finish or abort them) and close connections."""
        await self._migrations.close()
        await self._fleet.close()
        if self._router_queues is not None:
            await self._router_queues.close()

    def status(self) -> ServiceStatus:
        rows = []
        load_model = self.settings.load_model
        for instance_id, info in sorted(self._fleet.instances.items()):
            load = self._fleet.load(instance_id)
            rows.append(InstanceStatus(
                instance_id=instance_id, phase=info.phase.value, address=info.address,
                freeness=freeness(load, load_model) if load is not None else None,
                running=len(load.running) if load is not None else 0,
                waiting=len(load.waiting) if load is not None else 0,
                draining=instance_id in self._drains, message=info.message,
                block_size=load.block_size if load is not None else None))
        return ServiceStatus(
            name=self.settings.name, desired=self.desired, instances=tuple(rows),
            aggregate_freeness=self._aggregate_freeness(), migrations=dict(self._migrations.outcomes),
            scale_ups=self._reconciler.scale_ups, drains=self._drains.marked, releases=self._drains.releases,
            replacements=self._backoff.replacements, last_decision=self._reporter.last_decision)

    async def drain(self, instance_id: str) -> None:
        """Maintenance drain: no new requests, running ones migrate out, then the instance is released
        (and replaced while the count is below the target)."""
        self._fleet.ready_connection(instance_id)
        self._drains.mark(instance_id, "admin", "drain requested through the admin API")
        await self._fleet.push_draining(instance_id)

    async def undrain(self, instance_id: str) -> None:
        self._fleet.ready_connection(instance_id)
        self._drains.cancel(instance_id, "drain cancelled through the admin API")
        await self._fleet.push_draining(instance_id)

    async def migrate(self, request_id: str | None, source_id: str, destination_id: str
                      ) -> mpb.MigrateOutResponse:
        """Tell `source_id`'s llumlet to move `request_id` (None: its choice) to `destination_id`.
        gRPC errors propagate (UNIMPLEMENTED where the llumlet cannot migrate)."""
        source = self._fleet.ready_connection(source_id)
        destination = self._fleet.ready_connection(destination_id)
        if source_id == destination_id:
            raise ValueError("source and destination are the same instance")
        request = migrate_request(destination_id, destination.address, request_id, self.settings)
        return await self._migrations.migrate_now(source, request)

    # ---- the passes ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        now = self.clock()
        listed = await self._fleet.observe()
        spec = self.settings.spec  # read after the await: a spec change may have arrived meanwhile
        self._drains.keep_only(self._fleet.instances)
        for instance_id in self._fleet.first_reports_draining():
            self._drains.adopt(instance_id)
        if self._autoscaling.target is None and spec.autoscaling.enabled and self._fleet.adoption_done():
            self._autoscaling.adopt_target(spec.instances.min, spec.instances.max)
        await self._reconciler.replace_unhealthy(listed, now, spec.autoscaling.startup_grace_s)
        # Parking is the autoscaler's: a scale-down someone asked for (replicas) releases at once.
        park_s = self.settings.autoscaling.park_s if spec.autoscaling.enabled else 0.0
        await self._reconciler.release_drained(now, self._migrations.migrating, self.drain_timeout_s, park_s)
        await self._meet_target()
        if all(i.phase is InstancePhase.READY for i in self._fleet.instances.values()) \
                and len(self._fleet.instances) >= self.desired:
            self._backoff.all_serving()

    async def migrate_pass(self) -> None:
        """Pair sources with destinations and start one MigrateOut per free source; the requests the
        routers hold count as queued where they would go (`with_held_requests`)."""
        held: list[int] = []
        # Not read while an instance drains (they would not count): a slow router must not delay the
        # passes that move a draining instance's requests out.
        if self._router_queues is not None and held_requests_apply(self._fleet.loads()):
            held = await self._router_queues.held_tokens()
        # The loads as they are after the read, which may have taken a while.
        self._migrations.run(with_held_requests(self._fleet.loads(), held), self.settings)

    async def autoscale(self) -> None:
        """One autoscaling decision; it moves the target (reconcile starts, drains and releases)."""
        held = self._router_queues.held_tokens if self._router_queues is not None else None
        if await self._autoscaling.step(self.settings, self.desired, held):
            await self._meet_target()

    # ---- helpers ------------------------------------------------------------------------------

    async def _meet_target(self) -> None:
        """Act on the count once it is known: every instance's draining flag adopted, and with
        autoscaling on, its target."""
        if not self._fleet.adoption_done() or (self.settings.spec.autoscaling.enabled
                                               and self._autoscaling.target is None):
            return
        await self._reconciler.meet_target(self.desired, self.settings.load_model)

    def _aggregate_freeness(self) -> float | None:
        """The READY instances seen as one (draining ones count neither capacity nor requests)."""
        serving = [load for load in self._fleet.loads() if not load.draining]
        return aggregate_freeness(serving, self.settings.load_model) if serving else None

    def _sleep_s(self) -> float:
        interval = self.reconcile_interval_s
        migration = self.settings.spec.migration
        if migration.enabled:
            interval = min(interval, migration.interval_ms / 1000)
        return max(interval, 0.01)
