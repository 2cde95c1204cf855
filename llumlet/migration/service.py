"""The `LlumletMigration` gRPC service (proto/llumnix/v1/migration.proto): MigrateOut for the control
loop and admins, Propose/Renew/Commit/Abort between llumlets. Registered on the llumlet's gRPC server."""

from __future__ import annotations

import grpc

from llumlet.migration.destination import Destination
from llumlet.migration.source import Source
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1 import migration_pb2_grpc


class MigrationService(migration_pb2_grpc.LlumletMigrationServicer):
    def __init__(self, source: Source, destination: Destination) -> None:
        self.source = source
        self.destination = destination

    async def MigrateOut(self, request: mpb.MigrateOutRequest, context: grpc.aio.ServicerContext
                         ) -> mpb.MigrateOutResponse:
        if not request.destination_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "destination_address is required")
        return await self.source.migrate_out(request)

    async def Propose(self, request: mpb.ProposeMigrationRequest, context: grpc.aio.ServicerContext
                      ) -> mpb.ProposeMigrationResponse:
        return await self.destination.propose(request)

    async def Renew(self, request: mpb.RenewMigrationRequest, context: grpc.aio.ServicerContext
                    ) -> mpb.RenewMigrationResponse:
        return self.destination.renew(request)

    async def Commit(self, request: mpb.CommitMigrationRequest, context: grpc.aio.ServicerContext
                     ) -> mpb.CommitMigrationResponse:
        return await self.destination.commit(request)

    async def Abort(self, request: mpb.AbortMigrationRequest, context: grpc.aio.ServicerContext
                    ) -> mpb.AbortMigrationResponse:
        return self.destination.abort(request)
