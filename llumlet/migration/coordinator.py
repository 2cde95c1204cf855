"""A llumlet's migration coordinator: the engine channel, both roles and their shared bookkeeping,
started and stopped with the llumlet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from llumlet.admission import Admission
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.destination import Destination
from llumlet.migration.engine_link import EngineLink
from llumlet.migration.settings import MigrationSettings
from llumlet.migration.source import Source
from llumnix.engine.handshake import default_handshake_path, read_handshake
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumlet.migration")


class HandshakeFile:
    """The engine's handshake record, read when needed (the engine writes it once its cache exists)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __call__(self) -> dict[str, object] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            return read_handshake(self.path)
        except (OSError, ValueError) as exc:
            logger.warning("unreadable handshake record", extra={"path": str(self.path), "reason": str(exc)})
            return None


class MigrationCoordinator:
    def __init__(self, instance_id: str, address: str, snapshot_addr: str, admission: Admission,
                 tracker: LoadTracker, metrics: LlumletMetrics, settings: MigrationSettings,
                 token: ServiceToken | None) -> None:
        """`token`: what this llumlet presents to its peers (the service's, which they require)."""
        self.link = EngineLink(snapshot_addr)
        handshake = HandshakeFile(default_handshake_path(snapshot_addr))
        self.destination = Destination(instance_id, admission, tracker, self.link, handshake, settings,
                                       metrics)
        self.source = Source(instance_id, address, admission, tracker, self.link, handshake, settings,
                             metrics, incoming=lambda: len(self.destination.reservations), token=token)
        self.destination.outgoing = lambda: len(self.source.active)
        self._expiry: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.link.start()
        self._expiry = asyncio.create_task(self.destination.expire(), name="migration-leases")

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        await self.destination.close()
        await self.source.close()
        await self.link.close()
