"""The per-service control loop, shared by local mode (`llumnix up`) and the operator.

Level-based: every pass compares what the service should be (settings, the autoscaler's target)
with what the backend and the llumlets' load streams say it is, and acts on the difference, so a
restarted loop over the same instances adopts them and changes nothing. Each pass:

1. reconcile (every `reconcile_interval_s`): list instances; follow the READY ones' load streams;
   stop and replace FAILED ones and those not READY within the start-up grace; push the draining
   flag the loop wants to each llumlet; release drained instances once empty (or after the drain
   timeout); start or drain instances until the serving count meets the target.
2. migrate (every migration interval): `pair_migrations` over the loads (draining instances are
   sources) and `MigrateOut` on each source, one migration in flight per source.
3. autoscale (every autoscaling interval, when enabled): `autoscaling.decide` moves the target.

Who owns the instance count: with autoscaling off, `settings.desired_instances` (the CR's
replicas); with it on, the loop (its target starts at the serving count it finds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.control.status import ControlEvent, InstanceStatus, ScalingDecision, ServiceStatus
from llumnix.llumlet_client import LlumletConnection
from llumnix.load import InstanceLoad, aggregate_freeness, freeness
from llumnix.policies import autoscaling
from llumnix.policies.migration import pair_migrations
from llumnix.service_spec import ServiceSettings
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb
from llumnix.wire import LoadReport

logger = logging.getLogger("llumnix.control")

_SELECT = {"last-come": mpb.MIGRATION_SELECT_LAST_COME, "shortest": mpb.MIGRATION_SELECT_SHORTEST,
           "longest": mpb.MIGRATION_SELECT_LONGEST}
ADOPT_WAIT_S = 10.0
"""After (re)start, the count is not touched until every READY instance reported its load once (so
draining instances are known), or this long at most (an instance whose load never comes)."""
REPLACE_BACKOFF_MAX_S = 60.0
"""Successive failures delay each successor 0, 1, 2, 4, ... s up to this (a crash-looping image must
not be restarted every pass); the count resets once every instance serves."""
EMPTY_BEFORE_RELEASE_S = 1.0
"""A drained instance must report no requests for this long before it is stopped: a request the
router dispatched just before the drain may not be listed yet."""


class LlumletHandle(Protocol):
    """What the loop needs of a llumlet (`LlumletConnection`; tests pass fakes)."""

    address: str
    report: LoadReport | None

    def start(self) -> None: ...

    async def close(self) -> None: ...

    def connected(self, now: float | None = None) -> bool: ...

    async def set_draining(self, draining: bool) -> pb.SetDrainingResponse: ...

    async def migrate_out(self, request: mpb.MigrateOutRequest) -> mpb.MigrateOutResponse: ...


class UnknownInstance(KeyError):
    """The named instance is not READY (or does not exist)."""

    def __str__(self) -> str:
        return f"instance {self.args[0]!r} is not a ready instance of this service"


@dataclass
class _Drain:
    since: float
    reason: str
    """"scale-down" (the loop chose it; cancelled when the count falls short), "admin" or "adopted"."""
    empty_since: float | None = None


def outcome_name(outcome: int) -> str:
    return mpb.MigrationOutcome.Name(outcome).removeprefix("MIGRATION_OUTCOME_").lower()


class ControlLoop:
    def __init__(self, settings: ServiceSettings, backend: InstanceBackend, *,
                 on_event: Callable[[ControlEvent], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 connect: Callable[[str], LlumletHandle] = LlumletConnection,
                 on_addresses: Callable[[frozenset[str]], None] | None = None,
                 reconcile_interval_s: float = 1.0,
                 drain_timeout_s: float = 600.0) -> None:
        """`connect(address)` makes a llumlet connection (not started); `on_addresses` receives the
        READY instances' llumlet addresses whenever they change (local mode's router follows it)."""
        self.settings = settings
        self.backend = backend
        self.on_event = on_event
        self.clock = clock
        self.connect = connect
        self.on_addresses = on_addresses
        self.reconcile_interval_s = reconcile_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.instances: dict[str, InstanceInfo] = {}
        self.connections: dict[str, LlumletHandle] = {}
        self._adopted: set[str] = set()
        """Instances whose first load was read (their draining flag adopted)."""
        self.draining: dict[str, _Drain] = {}
        self.target: int | None = None
        """Autoscaling's instance count (None: not yet adopted)."""
        self._migrations: dict[str, asyncio.Task[None]] = {}
        """Source instance -> its MigrateOut in flight."""
        self._migrating_to: dict[str, str] = {}
        self._scale_down_wanted_since: float | None = None
        self._addresses: frozenset[str] = frozenset()
        self._unsupported_logged = False
        self._started_at = time.monotonic()
        self._replacing = 0
        """Instances stopped as failed whose successor has not been started yet."""
        self._failures_in_row = 0
        self._replace_not_before = -float("inf")
        self.migration_outcomes: dict[str, int] = {}
        self.scale_ups = self.drains = self.releases = self.replacements = 0
        self.last_decision: ScalingDecision | None = None

    # ---- public API ---------------------------------------------------------------------------

    def update_settings(self, settings: ServiceSettings) -> None:
        """A spec change (including replicas from /scale): acted on at the next reconcile."""
        self.settings = settings

    @property
    def desired(self) -> int:
        low, high = self.settings.spec["instances"]["min"], self.settings.spec["instances"]["max"]
        if self.settings.spec["autoscaling"]["enabled"] and self.target is not None:
            return min(max(self.target, low), high)
        return min(max(self.settings.desired_instances, low), high)

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
                    if self.settings.spec["migration"]["enabled"]:
                        self.migrate_pass()
                    if self.settings.spec["autoscaling"]["enabled"] and now >= next_autoscale:
                        await self.autoscale()
                        next_autoscale = now + self.settings.spec["autoscaling"]["intervalSeconds"]
                except Exception:  # a backend hiccup must not end the loop
                    logger.exception("control loop pass failed")
                await asyncio.sleep(self._sleep_s())
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel migrations in flight (the llumlets finish or abort them) and close connections."""
        for task in list(self._migrations.values()):
            task.cancel()
        await asyncio.gather(*self._migrations.values(), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.connections.values()), return_exceptions=True)
        self.connections.clear()

    def status(self) -> ServiceStatus:
        rows = []
        for instance_id, info in sorted(self.instances.items()):
            load = self._load(instance_id)
            rows.append(InstanceStatus(
                instance_id=instance_id, phase=info.phase.value, address=info.address,
                freeness=freeness(load, self.settings.load_model) if load is not None else None,
                running=len(load.running) if load is not None else 0,
                waiting=len(load.waiting) if load is not None else 0,
                draining=instance_id in self.draining, message=info.message))
        serving = [load for load in self._loads() if not load.draining]
        return ServiceStatus(
            name=self.settings.name, desired=self.desired, instances=tuple(rows),
            aggregate_freeness=aggregate_freeness(serving, self.settings.load_model) if serving else None,
            migrations=dict(self.migration_outcomes), scale_ups=self.scale_ups, drains=self.drains,
            releases=self.releases, replacements=self.replacements, last_decision=self.last_decision)

    async def drain(self, instance_id: str) -> None:
        """Maintenance drain: no new requests, running ones migrate out, then the instance is released
        (and replaced while the count is below the target)."""
        self._ready_connection(instance_id)
        self._mark_draining(instance_id, "admin", "drain requested through the admin API")
        await self._push_draining(instance_id)

    async def undrain(self, instance_id: str) -> None:
        self._ready_connection(instance_id)
        if self.draining.pop(instance_id, None) is not None:
            self._event("Normal", "DrainCancelled", "drain cancelled through the admin API", instance_id)
        await self._push_draining(instance_id)

    async def migrate(self, request_id: str | None, source_id: str, destination_id: str
                      ) -> mpb.MigrateOutResponse:
        """Tell `source_id`'s llumlet to move `request_id` (None: its choice) to `destination_id`.
        gRPC errors propagate (UNIMPLEMENTED where the llumlet cannot migrate)."""
        source = self._ready_connection(source_id)
        destination = self._ready_connection(destination_id)
        if source_id == destination_id:
            raise ValueError("source and destination are the same instance")
        response = await source.migrate_out(self._migrate_request(destination_id, destination.address,
                                                                  request_id))
        self._count(outcome_name(response.outcome))
        return response

    # ---- reconcile ----------------------------------------------------------------------------

    async def reconcile(self) -> None:
        now = self.clock()
        listed = await self.backend.list_instances()
        self.instances = {i.instance_id: i for i in listed}
        await self._follow_ready()
        grace = self.settings.spec["autoscaling"]["startupGraceSeconds"]
        for info in listed:
            if info.phase is InstancePhase.FAILED:
                await self._replace(info, f"instance failed: {info.message or 'no reason given'}")
            elif info.phase is InstancePhase.STARTING and now - info.created_at > grace:
                await self._replace(info, f"not ready {grace:.0f} s after it was created")
        for instance_id in list(self.draining):
            await self._advance_drain(instance_id, now)
        await self._meet_target()
        if all(i.phase is InstancePhase.READY for i in self.instances.values()) \
                and len(self.instances) >= self.desired:
            self._failures_in_row = 0

    async def _follow_ready(self) -> None:
        ready = {i.instance_id: i.address for i in self.instances.values()
                 if i.phase is InstancePhase.READY and i.address}
        for instance_id in list(self.connections):
            if ready.get(instance_id) != self.connections[instance_id].address:
                await self.connections.pop(instance_id).close()
                self._adopted.discard(instance_id)
        for instance_id, address in ready.items():
            if instance_id not in self.connections:
                connection = self.connect(address)
                connection.start()
                self.connections[instance_id] = connection
        for instance_id in set(self.draining) - set(self.instances):
            del self.draining[instance_id]  # gone (stopped elsewhere, or its failure was handled)
        addresses = frozenset(a for a in ready.values() if a)
        if addresses != self._addresses:
            self._addresses = addresses
            if self.on_addresses is not None:
                self.on_addresses(addresses)
        for instance_id, connection in self.connections.items():
            if instance_id in self._adopted or connection.report is None:
                continue
            self._adopted.add(instance_id)
            if connection.report.load.draining and instance_id not in self.draining:
                self.draining[instance_id] = _Drain(self.clock(), "adopted")
                logger.info("adopted a draining instance", extra={"instance_id": instance_id})
        if self.target is None and self.settings.spec["autoscaling"]["enabled"] and self._adoption_done():
            self.target = sum(1 for i in self.instances.values()
                              if i.phase in (InstancePhase.STARTING, InstancePhase.READY)
                              and i.instance_id not in self.draining)

    def _adoption_done(self) -> bool:
        ready = {i for i, info in self.instances.items() if info.phase is InstancePhase.READY}
        return ready <= self._adopted or time.monotonic() - self._started_at > ADOPT_WAIT_S

    async def _replace(self, info: InstanceInfo, why: str) -> None:
        self._event("Warning", "InstanceFailed", f"{why}; replacing it", info.instance_id)
        self._decide("replace", why, info.instance_id)
        self.replacements += 1
        self._replacing += 1
        self._failures_in_row += 1
        delay = 0.0 if self._failures_in_row == 1 else 2.0 ** (self._failures_in_row - 2)
        self._replace_not_before = self.clock() + min(delay, REPLACE_BACKOFF_MAX_S)
        self.draining.pop(info.instance_id, None)
        await self._stop(info.instance_id)

    async def _advance_drain(self, instance_id: str, now: float) -> None:
        drain = self.draining[instance_id]
        info = self.instances.get(instance_id)
        if info is None or info.phase is not InstancePhase.READY:
            return
        await self._push_draining(instance_id)
        load = self._load(instance_id)
        empty = (load is not None and load.num_requests == 0 and load.migrating_out == 0
                 and instance_id not in self._migrations)
        drain.empty_since = (drain.empty_since or now) if empty else None
        if drain.empty_since is not None and now - drain.empty_since >= EMPTY_BEFORE_RELEASE_S:
            self._decide("release", "drained instance is empty", instance_id)
            self._event("Normal", "Released", "drained and empty; stopping it", instance_id)
            self.releases += 1
        elif now - drain.since > self.drain_timeout_s:
            running = load.num_requests if load is not None else "unknown"
            self._decide("release", f"drain timeout ({self.drain_timeout_s:.0f} s)", instance_id)
            self._event("Warning", "DrainTimeout", f"still holds {running} requests after "
                        f"{self.drain_timeout_s:.0f} s of draining; stopping it anyway", instance_id)
            self.releases += 1
        else:
            return
        del self.draining[instance_id]
        await self._stop(instance_id)

    async def _meet_target(self) -> None:
        autoscaled = self.settings.spec["autoscaling"]["enabled"]
        if not self._adoption_done() or (autoscaled and self.target is None):
            return
        live = [i for i in self.instances.values()
                if i.phase in (InstancePhase.STARTING, InstancePhase.READY)]
        serving = [i for i in live if i.instance_id not in self.draining]
        shortfall = self.desired - len(serving)
        if shortfall > 0:
            for instance_id in sorted(i for i, d in self.draining.items() if d.reason != "admin")[:shortfall]:
                del self.draining[instance_id]
                self._event("Normal", "DrainCancelled", "instances are needed again", instance_id)
                await self._push_draining(instance_id)
                shortfall -= 1
            for _ in range(shortfall):
                if self._replacing and self.clock() < self._replace_not_before:
                    break  # backing off after repeated failures
                info = await self.backend.start_instance()
                self.instances[info.instance_id] = info
                serving.append(info)
                if self._replacing:
                    self._replacing -= 1
                    self._event("Normal", "Replaced", "started a successor for a failed instance",
                                info.instance_id)
                else:
                    self.scale_ups += 1
                    self._event("Normal", "ScaledUp", f"started an instance ({len(serving)} of "
                                f"{self.desired})", info.instance_id)
        else:
            self._replacing = 0  # the target was met otherwise (a lower desired count)
        if shortfall < 0:
            # Surplus: instances still starting hold no requests, stop those first; then drain.
            starting = sorted((i for i in serving if i.phase is InstancePhase.STARTING),
                              key=lambda i: -i.created_at)
            for info in starting[:-shortfall]:
                self._event("Normal", "ScaledDown", "surplus instance stopped before it served",
                            info.instance_id)
                await self._stop(info.instance_id)
                shortfall += 1
            loads = [load for load in self._loads() if not load.draining]
            while shortfall < 0 and loads:
                victim = autoscaling.drain_candidate(loads, self.settings.load_model)
                assert victim is not None
                self._mark_draining(victim, "scale-down", f"more instances than the {self.desired} desired")
                await self._push_draining(victim)
                loads = [load for load in loads if load.instance_id != victim]
                shortfall += 1

    async def _stop(self, instance_id: str) -> None:
        connection = self.connections.pop(instance_id, None)
        self._adopted.discard(instance_id)
        if connection is not None:
            await connection.close()
        self.instances.pop(instance_id, None)
        await self.backend.stop_instance(instance_id)

    def _mark_draining(self, instance_id: str, reason: str, why: str) -> None:
        if instance_id in self.draining:
            return
        self.draining[instance_id] = _Drain(self.clock(), reason)
        self.drains += 1
        self._decide("drain", why, instance_id)
        self._event("Normal", "Draining", f"{why}; migrating its requests out", instance_id)

    async def _push_draining(self, instance_id: str) -> None:
        """Make the llumlet's draining flag what the loop wants (it reports it in every load)."""
        connection = self.connections.get(instance_id)
        if connection is None:
            return
        wanted = instance_id in self.draining
        if connection.report is not None and connection.report.load.draining == wanted:
            return
        try:
            await connection.set_draining(wanted)
        except grpc.aio.AioRpcError as exc:
            logger.warning("SetDraining failed; retrying next pass",
                           extra={"instance_id": instance_id, "code": exc.code().name})

    # ---- migration ----------------------------------------------------------------------------

    def migrate_pass(self) -> None:
        """Pair sources with destinations and start one MigrateOut per free source."""
        loads = []
        for load in self._loads():
            busy_out = 1 if load.instance_id in self._migrations else 0
            busy_in = sum(1 for d in self._migrating_to.values() if d == load.instance_id)
            loads.append(replace(load, migrating_out=max(load.migrating_out, busy_out),
                                 migrating_in=max(load.migrating_in, busy_in)))
        for pair in pair_migrations(loads, self.settings.migration, self.settings.load_model):
            destination = self.connections[pair.destination]
            request = self._migrate_request(pair.destination, destination.address, None)
            task = asyncio.create_task(self._migrate_out(pair.source, request),
                                       name=f"migrate-out {pair.source}")
            self._migrations[pair.source] = task
            self._migrating_to[pair.source] = pair.destination

    def _migrate_request(self, destination_id: str, address: str, request_id: str | None
                         ) -> mpb.MigrateOutRequest:
        return mpb.MigrateOutRequest(destination_instance_id=destination_id, destination_address=address,
                                     request_id=request_id or "",
                                     select=_SELECT[self.settings.spec["migration"]["select"]])

    async def _migrate_out(self, source_id: str, request: mpb.MigrateOutRequest) -> None:
        try:
            connection = self.connections.get(source_id)
            if connection is None:
                return
            response = await connection.migrate_out(request)
            self._count(outcome_name(response.outcome))
            logger.info("migration ended", extra={
                "source": source_id, "destination": request.destination_instance_id,
                "outcome": outcome_name(response.outcome), "request_id": response.request_id,
                "reason": response.reason})
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._count("unsupported")
                if not self._unsupported_logged:
                    self._unsupported_logged = True
                    logger.warning("llumlet cannot migrate (MigrateOut unimplemented)",
                                   extra={"instance_id": source_id})
            else:
                self._count("error")
                logger.warning("MigrateOut failed", extra={"source": source_id, "code": exc.code().name,
                                                           "details": exc.details()})
        finally:
            self._migrations.pop(source_id, None)
            self._migrating_to.pop(source_id, None)

    def _count(self, outcome: str) -> None:
        self.migration_outcomes[outcome] = self.migration_outcomes.get(outcome, 0) + 1

    # ---- autoscaling --------------------------------------------------------------------------

    async def autoscale(self) -> None:
        """One autoscaling decision; it moves the target (reconcile starts, drains and releases)."""
        ready = [i for i, info in self.instances.items() if info.phase is InstancePhase.READY]
        loads = self._loads()
        if self.target is None or len(loads) < len(ready):
            return  # a READY instance without a load yet: decide on the whole picture only
        starting = sum(1 for info in self.instances.values() if info.phase is InstancePhase.STARTING)
        config = self.settings.autoscaling
        action = autoscaling.decide(loads, starting, config, self.settings.load_model)
        if action.kind != "drain":
            self._scale_down_wanted_since = None
        if action.kind == "scale-up":
            self.target = min(self.desired + 1, config.max_instances)
            self._decide("scale-up", action.reason)
        elif action.kind == "cancel-drain" and action.instance_id is not None:
            self.draining.pop(action.instance_id, None)
            self.target = min(self.desired + 1, config.max_instances)
            self._decide("cancel-drain", action.reason, action.instance_id)
            self._event("Normal", "DrainCancelled", action.reason, action.instance_id)
            await self._push_draining(action.instance_id)
        elif action.kind == "drain" and action.instance_id is not None:
            now = self.clock()
            if self._scale_down_wanted_since is None:
                self._scale_down_wanted_since = now
            stabilization = self.settings.spec["autoscaling"]["scaleDownStabilizationSeconds"]
            if now - self._scale_down_wanted_since >= stabilization:
                self._scale_down_wanted_since = None
                self.target = max(self.desired - 1, config.min_instances)
                self._mark_draining(action.instance_id, "scale-down", action.reason)
                await self._push_draining(action.instance_id)
        else:
            return
        await self._meet_target()

    # ---- helpers ------------------------------------------------------------------------------

    def _load(self, instance_id: str) -> InstanceLoad | None:
        connection = self.connections.get(instance_id)
        if connection is None or connection.report is None or not connection.connected():
            return None
        load = connection.report.load
        wanted = instance_id in self.draining
        return load if load.draining == wanted else replace(load, draining=wanted)

    def _loads(self) -> list[InstanceLoad]:
        """Live loads of READY instances, with the draining flag the loop wants (a flag just pushed
        shows in the next load)."""
        loads = []
        for instance_id, info in self.instances.items():
            load = self._load(instance_id) if info.phase is InstancePhase.READY else None
            if load is not None:
                loads.append(replace(load, instance_id=instance_id) if load.instance_id != instance_id
                             else load)
        return loads

    def _ready_connection(self, instance_id: str) -> LlumletHandle:
        info = self.instances.get(instance_id)
        connection = self.connections.get(instance_id)
        if info is None or info.phase is not InstancePhase.READY or connection is None:
            raise UnknownInstance(instance_id)
        return connection

    def _sleep_s(self) -> float:
        interval = self.reconcile_interval_s
        if self.settings.spec["migration"]["enabled"]:
            interval = min(interval, self.settings.spec["migration"]["intervalMs"] / 1000)
        return max(interval, 0.01)

    def _decide(self, kind: str, reason: str, instance_id: str | None = None) -> None:
        self.last_decision = ScalingDecision(kind, reason, self.clock(), instance_id)

    def _event(self, kind: str, reason: str, message: str, instance_id: str | None = None) -> None:
        event = ControlEvent(kind, reason, message, instance_id)
        log = logger.warning if kind == "Warning" else logger.info
        log(message, extra={"reason": reason, "instance_id": instance_id})
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # the listener's failure must not stop the loop
                logger.exception("event listener failed")

