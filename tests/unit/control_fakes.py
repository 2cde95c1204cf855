"""In-memory fakes for control-loop tests: a backend whose instances the test moves through their
phases, llumlet connections whose loads the test sets (and which record control calls), a clock."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.control.loop import ControlLoop
from llumnix.control.router_queues import RouterQueues
from llumnix.control.status import ControlEvent
from llumnix.load import InstanceLoad, RequestLoad
from llumnix.service_spec import ServiceSettings, parse_service
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb
from llumnix.wire import LoadReport, LoadSource

TOTAL_BLOCKS = 100


def settings(**spec: Any) -> ServiceSettings:
    base: dict[str, Any] = {"model": {"name": "m"}, "engine": {"runtime": "sim"},
                            "instances": {"min": 1, "max": 6}, "replicas": 2,
                            "autoscaling": {"enabled": False, "startupGraceSeconds": 30.0}}
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    return parse_service({"apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService",
                          "metadata": {"name": "svc"}, "spec": base})


def request(request_id: str, blocks: int, arrival: float = 0.0) -> RequestLoad:
    return RequestLoad(request_id, prompt_tokens=blocks * 16, blocks=blocks, arrival_time=arrival)


class FakeBackend(InstanceBackend):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.infos: dict[str, InstanceInfo] = {}
        self.started: list[str] = []
        self.stopped: list[str] = []
        self._next = 0

    async def list_instances(self) -> list[InstanceInfo]:
        return list(self.infos.values())

    async def start_instance(self) -> InstanceInfo:
        instance_id = f"i{self._next}"
        self._next += 1
        info = InstanceInfo(instance_id, InstancePhase.STARTING, None, self.clock())
        self.infos[instance_id] = info
        self.started.append(instance_id)
        return info

    async def stop_instance(self, instance_id: str) -> None:
        self.stopped.append(instance_id)
        self.infos.pop(instance_id, None)

    async def close(self) -> None:
        self.infos.clear()

    def ready(self, instance_id: str) -> None:
        self.infos[instance_id] = replace(self.infos[instance_id], phase=InstancePhase.READY,
                                          address=f"addr-{instance_id}")

    def set_phase(self, instance_id: str, phase: InstancePhase, message: str = "") -> None:
        self.infos[instance_id] = replace(self.infos[instance_id], phase=phase, message=message)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLlumlet:
    """A llumlet connection whose load the test sets; records control calls."""

    def __init__(self, address: str, loads: dict[str, InstanceLoad], migrations: list[Any]) -> None:
        self.address = address
        self.instance_id = address.removeprefix("addr-")
        self._loads = loads
        self._migrations = migrations
        self.draining_calls: list[bool] = []
        self.closed = False
        self.migrate_result: mpb.MigrateOutResponse | Exception = mpb.MigrateOutResponse(
            outcome=mpb.MIGRATION_OUTCOME_COMMITTED)
        self.hold: asyncio.Event | None = None

    @property
    def report(self) -> LoadReport | None:
        load = self._loads.get(self.instance_id)
        return None if load is None else LoadReport(load, 0.0, 0.0, 0.0, LoadSource.CONNECTOR)

    def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True

    def connected(self, now: float | None = None) -> bool:
        return self.instance_id in self._loads

    async def set_draining(self, draining: bool) -> pb.SetDrainingResponse:
        self.draining_calls.append(draining)
        if self.instance_id in self._loads:
            self._loads[self.instance_id] = replace(self._loads[self.instance_id], draining=draining)
        return pb.SetDrainingResponse(draining=draining)

    async def migrate_out(self, request: mpb.MigrateOutRequest) -> mpb.MigrateOutResponse:
        self._migrations.append((self.instance_id, request))
        if self.hold is not None:
            await self.hold.wait()
        if isinstance(self.migrate_result, Exception):
            raise self.migrate_result
        return self.migrate_result


class Harness:
    def __init__(self, service: ServiceSettings, backend: FakeBackend | None = None,
                 loads: dict[str, InstanceLoad] | None = None,
                 router_queues: RouterQueues | None = None) -> None:
        self.clock = backend.clock if backend else FakeClock()
        self.backend = backend or FakeBackend(self.clock)
        self.loads: dict[str, InstanceLoad] = {} if loads is None else loads
        self.migrations: list[tuple[str, mpb.MigrateOutRequest]] = []
        self.events: list[ControlEvent] = []
        self.llumlets: dict[str, FakeLlumlet] = {}
        self.addresses: list[frozenset[str]] = []
        self.loop = ControlLoop(service, self.backend, on_event=self.events.append, clock=self.clock,
                                connect=self._connect, on_addresses=self.addresses.append,
                                router_queues=router_queues)

    def _connect(self, address: str) -> FakeLlumlet:
        llumlet = FakeLlumlet(address, self.loads, self.migrations)
        self.llumlets[llumlet.instance_id] = llumlet
        return llumlet

    def load(self, instance_id: str, *running: RequestLoad, free: int | None = None,
             draining: bool = False) -> None:
        used = sum(r.blocks for r in running)
        self.loads[instance_id] = InstanceLoad(instance_id, TOTAL_BLOCKS,
                                               TOTAL_BLOCKS - used if free is None else free,
                                               running=running, draining=draining)

    async def bring_up(self) -> list[str]:
        """Reconcile, then make every started instance READY with an idle load."""
        await self.loop.reconcile()
        for instance_id, info in list(self.backend.infos.items()):
            if info.phase is InstancePhase.STARTING:
                self.backend.ready(instance_id)
                self.load(instance_id)
        await self.loop.reconcile()
        return sorted(self.backend.infos)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]
