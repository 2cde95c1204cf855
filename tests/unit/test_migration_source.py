"""The source's Propose: it sends its --migration-transport; a channel in the answer that this llumlet or
its engine cannot use is refused, and the destination's reservation released at once."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from waiting import wait_until_async

from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.settings import MigrationSettings
from llumlet.migration.source import MigrationFailed, PeerStubs, Source, _Progress
from llumlet.requests import RequestRecord, RequestTable
from llumnix.openai_stream import EndpointKind
from llumnix.service_token import CallMetadata, ServiceToken, call_metadata
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.engine_pb2 import EngineSnapshot
from llumnix.v1.kv_transfer_pb2 import KVChannel

TOKEN = ServiceToken("service-token")


class FakeLink:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel_export(self, migration_id: str) -> None:
        self.cancelled.append(migration_id)


class FakeDestination:
    """A destination llumlet that chooses `transport` (with its channel when `opened`); it records the
    proposals and Abort."""

    def __init__(self, transport: str, opened: bool = True) -> None:
        self.transport = transport
        self.opened = opened
        self.proposals: list[mpb.ProposeMigrationRequest] = []
        self.aborted: list[str] = []
        self.presented: set[CallMetadata] = set()
        """The metadata every call carried (the service token)."""

    async def Propose(self, request: mpb.ProposeMigrationRequest, timeout: float, metadata: CallMetadata
                      ) -> Any:
        self.proposals.append(request)
        self.presented.add(metadata)
        answer = mpb.ProposeMigrationResponse(accepted=True, kv_address="tcp://127.0.0.1:9",
                                              transport=self.transport, lease_ms=1000)
        if self.transport != "tcp" and self.opened:
            answer.channel.CopyFrom(KVChannel(backend=self.transport, channel_id="c"))
        return answer

    async def Abort(self, request: mpb.AbortMigrationRequest, timeout: float, metadata: CallMetadata) -> Any:
        self.aborted.append(request.migration_id)
        self.presented.add(metadata)
        return mpb.AbortMigrationResponse(released=True)


async def _propose(transport: str, engine: list[str], destination: FakeDestination
                   ) -> tuple[mpb.ProposeMigrationResponse | MigrationFailed, FakeLink]:
    tracker = LoadTracker("s", RequestTable())
    tracker.on_snapshot(EngineSnapshot(engine_id="e", step=1, timestamp=time.time(), total_blocks=100,
                                       free_blocks=100, block_size=16))
    link = FakeLink()
    source = Source("s", "127.0.0.1:1", None, tracker, link,  # type: ignore[arg-type]
                    lambda: {"kv_channels": engine}, MigrationSettings(transport=transport),
                    LlumletMetrics("s", tracker.report), incoming=lambda: 0, token=TOKEN)
    record = RequestRecord("r", EndpointKind.COMPLETION, {"prompt": "x", "max_tokens": 10},
                           prompt_token_ids=(1, 2, 3), generated_token_ids={0: [4]}, migratable=True)
    progress = _Progress("m", record, destination, "127.0.0.1:2")  # type: ignore[arg-type]
    try:
        return await source._propose(progress), link
    except MigrationFailed as exc:
        return exc, link


CPU = ["tcp", "gloo"]
CUDA = ["tcp", "gloo", "nccl"]


@pytest.mark.parametrize(("transport", "engine", "channel"), [
    ("auto", CPU, "tcp"), ("auto", CPU, "gloo"), ("auto", CUDA, "nccl"), ("gloo", CPU, "gloo"),
    ("nccl", CUDA, "nccl"),
])
async def test_a_channel_the_llumlet_and_its_engine_can_use_is_taken(transport: str, engine: list[str],
                                                                    channel: str) -> None:
    destination = FakeDestination(channel)
    answer, _ = await _propose(transport, engine, destination)
    assert isinstance(answer, mpb.ProposeMigrationResponse) and answer.transport == channel
    assert destination.proposals[0].transport == transport  # negotiated by the destination
    assert destination.aborted == []
    assert destination.presented == {call_metadata(TOKEN)}  # the peer requires the service token


@pytest.mark.parametrize(("transport", "engine", "destination", "reason"), [
    ("tcp", CUDA, FakeDestination("nccl"), "over tcp only; the destination chose nccl"),
    ("nccl", CUDA, FakeDestination("tcp"), "over nccl only"),
    ("auto", CPU, FakeDestination("nccl"), "this engine has only tcp, gloo"),
    ("auto", CPU, FakeDestination("gloo", opened=False), "opened no gloo channel"),
])
async def test_a_channel_the_source_cannot_use_is_refused_and_released(
        transport: str, engine: list[str], destination: FakeDestination, reason: str) -> None:
    failed, link = await _propose(transport, engine, destination)
    assert isinstance(failed, MigrationFailed)
    assert failed.outcome == mpb.MIGRATION_OUTCOME_REFUSED and reason in failed.reason
    assert destination.aborted == ["m"] and link.cancelled == ["m"]
    assert destination.presented == {call_metadata(TOKEN)}


async def test_the_channel_to_a_peer_reports_its_connection_dropping_when_the_peer_dies() -> None:
    """What lets a source renew at once, not a quarter lease later, when the destination's llumlet dies:
    its channel leaves READY without a call as the peer's server goes away."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peers = PeerStubs(TOKEN)
    address = f"127.0.0.1:{port}"
    try:
        assert not peers.connected(address)  # no channel yet
        stub = peers.stub(address)
        with pytest.raises(grpc.aio.AioRpcError, match="UNIMPLEMENTED"):  # a call connects the channel
            await stub.Renew(mpb.RenewMigrationRequest(migration_id="m"), timeout=5)
        assert peers.connected(address)
        await server.stop(None)

        async def dropped() -> bool:
            return not peers.connected(address)

        await wait_until_async(dropped, "the channel to leave READY after its peer stopped", timeout_s=10)
    finally:
        await peers.close()
