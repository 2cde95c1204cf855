"""The engine's migration staging as its llumlet sees it: the sim engine's migration agent (the same
`StagingStore` and event channel as the vLLM connector) reports what it holds as STAGING_HELD events;
the llumlet's engine link keeps the newest and its /metrics exports it. A staged migration shows, and
goes back to 0 once it is dropped (DropStaging), loaded (the migrated-in request arrives) or its lease
runs out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest_asyncio
from waiting import wait_until

from llumlet.metrics import LlumletMetrics
from llumlet.migration.engine_link import STAGING_REPORT_STALE_S, EngineLink
from llumnix.engine.engine_channel import EngineCommandClient, control_address
from llumnix.engine.handshake import migration_key
from llumnix.engine.kv_transport import KV_FRAME_SCHEMA_VERSION
from llumnix.engine.kv_transport_factory import make_sender
from llumnix.openai_stream import EndpointKind
from llumnix.sim_engine.migration import SIM_KV_DTYPE, SimMigrationAgent
from llumnix.sim_engine.requests import GenerationRequest
from llumnix.sim_engine.server import SimEngineConfig, build_engine
from llumnix.v1.kv_transfer_pb2 import DropStaging, EngineCommand, KVStageHeader

BLOCK = 64  # fake KV bytes per block
BLOCK_SIZE = 16


@dataclass
class Destination:
    agent: SimMigrationAgent
    link: EngineLink
    metrics: LlumletMetrics
    commands: EngineCommandClient

    def staged(self) -> tuple[float | None, float | None]:
        """(migrations, bytes) on the llumlet's /metrics."""
        registry, labels = self.metrics.registry, {"instance_id": "d"}
        return (registry.get_sample_value("llumnix_llumlet_engine_staged_migrations", labels),
                registry.get_sample_value("llumnix_llumlet_engine_staging_bytes", labels))

    async def stage(self, migration_id: str, blocks: int) -> None:
        """One stage of `blocks` blocks, sent to the engine's KV receiver as a source engine does."""
        header = KVStageHeader(
            schema_version=KV_FRAME_SCHEMA_VERSION, migration_id=migration_id, stage=1, first_block=0,
            num_blocks=blocks, num_tokens=blocks * BLOCK_SIZE, payload_bytes=blocks * BLOCK,
            bytes_per_block=BLOCK, dtype=SIM_KV_DTYPE,
            kv_key=migration_key(self.agent.receiver.kv_secret, migration_id))
        sender = make_sender("tcp", self.agent.receiver.address, timeout_s=10)
        try:
            await asyncio.to_thread(sender.send, header, bytes(header.payload_bytes))
        finally:
            sender.close()


@pytest_asyncio.fixture
async def destination(tmp_path) -> AsyncIterator[Destination]:
    addr = f"ipc://{tmp_path}/engine.sock"
    config = SimEngineConfig(snapshot_addr=addr, engine_id="d", num_blocks=100, block_size=BLOCK_SIZE,
                             max_model_len=512, kv_bytes_per_block=BLOCK)
    engine, _ = build_engine(config, None)
    agent = engine.migration = SimMigrationAgent(engine, addr, "127.0.0.1", "sim", BLOCK)
    agent.start()
    link = EngineLink(addr)
    link.start()
    commands = EngineCommandClient(control_address(addr))
    try:
        yield Destination(agent, link, LlumletMetrics("d", lambda: None, link.staging_held), commands)
    finally:
        commands.close()
        await link.close()
        agent.close()


async def test_staging_shows_while_staged_and_returns_to_zero_when_dropped_loaded_or_expired(
        destination: Destination) -> None:
    d = destination
    assert d.staged() == (None, None)  # nothing reported yet: no series, not a made-up 0
    await wait_until(lambda: d.staged() == (0, 0), "the engine's periodic report of empty staging")

    await d.stage("dropped", 2)
    await wait_until(lambda: d.staged() == (1, 2 * BLOCK), "a staged migration on the llumlet's metrics")
    reply = await d.commands.send(EngineCommand(drop_staging=DropStaging(migration_id="dropped")))
    assert reply.ok, reply.error
    await wait_until(lambda: d.staged() == (0, 0), "staging dropped by DropStaging")

    await d.stage("loaded", 3)
    await d.stage("expiring", 1)
    await wait_until(lambda: d.staged() == (2, 4 * BLOCK), "two staged migrations")
    d.agent.engine.add("r-loaded", GenerationRequest(
        EndpointKind.COMPLETION, tuple(range(1, 3 * BLOCK_SIZE + 1)), max_tokens=4,
        kv_transfer_params={"llumlet_migration_id": "loaded", "llumlet_staged_tokens": 3 * BLOCK_SIZE}))
    await wait_until(lambda: d.staged() == (1, BLOCK), "staging taken by the migrated-in request")

    d.agent.staging.lease_s = 0.0  # its lease has run out: the engine's reaper drops it
    await wait_until(lambda: d.staged() == (0, 0), "staging dropped when its lease ran out")

    # An engine that stopped reporting (it died, and its staging with it) shows nothing, not its last report.
    assert d.link.staging_held() is not None
    assert d.link.staging_held(now=time.monotonic() + STAGING_REPORT_STALE_S + 1) is None
