"""The migration pass: `pair_migrations` over the loads and one `MigrateOut` per source, at most one
in flight per source; also the admin API's explicit migrations. Outcomes are counted, never fatal."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from llumnix.control.fleet import Fleet, LlumletHandle
from llumnix.load import InstanceLoad
from llumnix.policies.migration import pair_migrations
from llumnix.service_spec import ServiceSettings
from llumnix.v1 import migration_pb2 as mpb

logger = logging.getLogger("llumnix.control")

SELECT = {"last-come": mpb.MIGRATION_SELECT_LAST_COME, "shortest": mpb.MIGRATION_SELECT_SHORTEST,
          "longest": mpb.MIGRATION_SELECT_LONGEST}
"""spec.migration.select -> the request the source llumlet picks."""


def outcome_name(outcome: int) -> str:
    return mpb.MigrationOutcome.Name(outcome).removeprefix("MIGRATION_OUTCOME_").lower()


class MigrationPass:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.outcomes: dict[str, int] = {}
        """Outcome name -> count."""
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        """Source instance -> its MigrateOut in flight."""
        self._destinations: dict[str, str] = {}
        """Source instance -> the destination of its MigrateOut in flight."""
        self._unsupported_logged = False

    def migrating(self, instance_id: str) -> bool:
        """Whether a MigrateOut this pass started from the instance is in flight."""
        return instance_id in self._in_flight

    def run(self, loads: list[InstanceLoad], settings: ServiceSettings) -> None:
        """Pair sources with destinations and start one MigrateOut per free source."""
        busy_loads = []
        for load in loads:
            busy_out = 1 if load.instance_id in self._in_flight else 0
            busy_in = sum(1 for d in self._destinations.values() if d == load.instance_id)
            busy_loads.append(replace(load, migrating_out=max(load.migrating_out, busy_out),
                                      migrating_in=max(load.migrating_in, busy_in)))
        for pair in pair_migrations(busy_loads, settings.migration, settings.load_model):
            destination = self.fleet.connections[pair.destination]
            request = migrate_request(pair.destination, destination.address, None, settings)
            task = asyncio.create_task(self._migrate_out(pair.source, request),
                                       name=f"migrate-out {pair.source}")
            self._in_flight[pair.source] = task
            self._destinations[pair.source] = pair.destination

    async def migrate_now(self, source: LlumletHandle, request: mpb.MigrateOutRequest
                          ) -> mpb.MigrateOutResponse:
        """One explicit migration (gRPC errors propagate: the caller reports them)."""
        response = await source.migrate_out(request)
        self._count(outcome_name(response.outcome))
        return response

    async def _migrate_out(self, source_id: str, request: mpb.MigrateOutRequest) -> None:
        try:
            connection = self.fleet.connections.get(source_id)
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
            self._in_flight.pop(source_id, None)
            self._destinations.pop(source_id, None)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def close(self) -> None:
        """Cancel migrations in flight (the llumlets finish or abort them)."""
        for task in list(self._in_flight.values()):
            task.cancel()
        await asyncio.gather(*self._in_flight.values(), return_exceptions=True)


def migrate_request(destination_id: str, address: str, request_id: str | None, settings: ServiceSettings
                    ) -> mpb.MigrateOutRequest:
    return mpb.MigrateOutRequest(destination_instance_id=destination_id, destination_address=address,
                                 request_id=request_id or "", select=SELECT[settings.spec.migration.select])
