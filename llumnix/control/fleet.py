"""The instances as the control loop sees them: what the backend lists, a load-stream connection to
each READY instance's llumlet, and the loads those report with the draining flag the loop wants."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container
from dataclasses import replace
from typing import Protocol

import grpc

from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.load import InstanceLoad
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb
from llumnix.wire import LoadReport

logger = logging.getLogger("llumnix.control")

ADOPT_WAIT_S = 10.0
"""After (re)start, the count is not touched until every READY instance reported its load once (so
draining instances are known), or this long at most (an instance whose load never comes)."""


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


class Fleet:
    def __init__(self, backend: InstanceBackend, connect: Callable[[str], LlumletHandle],
                 on_addresses: Callable[[frozenset[str]], None] | None, draining: Container[str]) -> None:
        """`draining`: the instances the loop wants draining (their loads say so, and `push_draining`
        tells their llumlets)."""
        self.backend = backend
        self.connect = connect
        self.on_addresses = on_addresses
        self.draining = draining
        self.instances: dict[str, InstanceInfo] = {}
        self.connections: dict[str, LlumletHandle] = {}
        self._reported: set[str] = set()
        """Instances whose first load was read."""
        self._addresses: frozenset[str] = frozenset()
        self._started_at = time.monotonic()

    async def observe(self) -> list[InstanceInfo]:
        """List the instances; connect to the READY ones, drop connections to the rest."""
        listed = await self.backend.list_instances()
        self.instances = {i.instance_id: i for i in listed}
        ready = {i.instance_id: i.address for i in listed if i.phase is InstancePhase.READY and i.address}
        for instance_id in list(self.connections):
            if ready.get(instance_id) != self.connections[instance_id].address:
                await self.connections.pop(instance_id).close()
                self._reported.discard(instance_id)
        for instance_id, address in ready.items():
            if instance_id not in self.connections:
                connection = self.connect(address)
                connection.start()
                self.connections[instance_id] = connection
        addresses = frozenset(ready.values())
        if addresses != self._addresses:
            self._addresses = addresses
            if self.on_addresses is not None:
                self.on_addresses(addresses)
        return listed

    def first_reports_draining(self) -> list[str]:
        """Instances whose first load arrived since the last call and says draining (a previous loop,
        or an admin, drained them)."""
        draining = []
        for instance_id, connection in self.connections.items():
            if instance_id in self._reported or connection.report is None:
                continue
            self._reported.add(instance_id)
            if connection.report.load.draining:
                draining.append(instance_id)
        return draining

    def adoption_done(self) -> bool:
        ready = {i for i, info in self.instances.items() if info.phase is InstancePhase.READY}
        return ready <= self._reported or time.monotonic() - self._started_at > ADOPT_WAIT_S

    def load(self, instance_id: str) -> InstanceLoad | None:
        connection = self.connections.get(instance_id)
        if connection is None or connection.report is None or not connection.connected():
            return None
        load = connection.report.load
        wanted = instance_id in self.draining
        return load if load.draining == wanted else replace(load, draining=wanted)

    def loads(self) -> list[InstanceLoad]:
        """Live loads of READY instances, with the draining flag the loop wants (a flag just pushed
        shows in the next load)."""
        loads = []
        for instance_id, info in self.instances.items():
            load = self.load(instance_id) if info.phase is InstancePhase.READY else None
            if load is not None:
                loads.append(replace(load, instance_id=instance_id) if load.instance_id != instance_id
                             else load)
        return loads

    def count(self, *phases: InstancePhase) -> int:
        return sum(1 for info in self.instances.values() if info.phase in phases)

    def ready_connection(self, instance_id: str) -> LlumletHandle:
        info = self.instances.get(instance_id)
        connection = self.connections.get(instance_id)
        if info is None or info.phase is not InstancePhase.READY or connection is None:
            raise UnknownInstance(instance_id)
        return connection

    async def push_draining(self, instance_id: str) -> None:
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

    async def start(self) -> InstanceInfo:
        info = await self.backend.start_instance()
        self.instances[info.instance_id] = info
        return info

    async def stop(self, instance_id: str) -> None:
        connection = self.connections.pop(instance_id, None)
        self._reported.discard(instance_id)
        if connection is not None:
            await connection.close()
        self.instances.pop(instance_id, None)
        await self.backend.stop_instance(instance_id)

    async def close(self) -> None:
        """Close the llumlet connections (the instances stay)."""
        await asyncio.gather(*(c.close() for c in self.connections.values()), return_exceptions=True)
        self.connections.clear()
