"""The source's Propose: a destination whose engine channel this llumlet's --migration-transport does
not allow is refused, and its reservation released at once."""

from __future__ import annotations

import time
from typing import Any

import pytest

from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.settings import MigrationSettings
from llumlet.migration.source import MigrationFailed, Source, _Progress
from llumlet.requests import RequestRecord, RequestTable
from llumnix.openai_stream import EndpointKind
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.engine_pb2 import EngineSnapshot


class FakeLink:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel_export(self, migration_id: str) -> None:
        self.cancelled.append(migration_id)


class FakeDestination:
    """A destination llumlet whose engine receives over `transport`; it records Abort."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.aborted: list[str] = []

    async def Propose(self, request: mpb.ProposeMigrationRequest, timeout: float) -> Any:
        return mpb.ProposeMigrationResponse(accepted=True, kv_address="tcp://127.0.0.1:9",
                                            transport=self.transport, lease_ms=1000)

    async def Abort(self, request: mpb.AbortMigrationRequest, timeout: float) -> Any:
        self.aborted.append(request.migration_id)
        return mpb.AbortMigrationResponse(released=True)


async def _propose(transport: str, engine: str, destination: FakeDestination
                   ) -> tuple[mpb.ProposeMigrationResponse | MigrationFailed, FakeLink]:
    tracker = LoadTracker("s", RequestTable())
    tracker.on_snapshot(EngineSnapshot(engine_id="e", step=1, timestamp=time.time(), total_blocks=100,
                                       free_blocks=100, block_size=16))
    link = FakeLink()
    source = Source("s", "127.0.0.1:1", None, tracker, link,  # type: ignore[arg-type]
                    lambda: {"kv_transport": engine}, MigrationSettings(transport=transport),
                    LlumletMetrics("s", tracker.report), incoming=lambda: 0)
    record = RequestRecord("r", EndpointKind.COMPLETION, {"prompt": "x", "max_tokens": 10},
                           prompt_token_ids=(1, 2, 3), generated_token_ids={0: [4]}, migratable=True)
    progress = _Progress("m", record, destination)  # type: ignore[arg-type]
    try:
        return await source._propose(progress), link
    except MigrationFailed as exc:
        return exc, link


@pytest.mark.parametrize(("transport", "engine", "channel"), [
    ("auto", "tcp", "tcp"), ("auto", "nccl", "nccl"), ("tcp", "nccl", "tcp"), ("nccl", "nccl", "nccl"),
])
async def test_a_destination_channel_the_llumlet_allows_is_used(transport: str, engine: str,
                                                                channel: str) -> None:
    destination = FakeDestination(channel)
    answer, _ = await _propose(transport, engine, destination)
    assert isinstance(answer, mpb.ProposeMigrationResponse) and answer.transport == channel
    assert destination.aborted == []


@pytest.mark.parametrize(("transport", "engine", "channel", "reason"), [
    ("tcp", "nccl", "nccl", "over tcp only"),
    ("nccl", "nccl", "tcp", "over nccl only"),
    ("auto", "tcp", "nccl", "the source engine runs tcp"),
])
async def test_a_destination_channel_the_llumlet_does_not_allow_is_refused_and_released(
        transport: str, engine: str, channel: str, reason: str) -> None:
    destination = FakeDestination(channel)
    failed, link = await _propose(transport, engine, destination)
    assert isinstance(failed, MigrationFailed)
    assert failed.outcome == mpb.MIGRATION_OUTCOME_REFUSED and reason in failed.reason
    assert destination.aborted == ["m"] and link.cancelled == ["m"]
