"""The llumlet <-> engine migration channel: commands answered by the engine's handler over real ZeroMQ
sockets, refusals for bad schemas and handler errors, timeouts that leave the client usable, events."""

import asyncio
import threading
import time

import pytest

from llumnix.engine.engine_channel import (
    ENGINE_COMMAND_SCHEMA_VERSION,
    EngineChannelError,
    EngineCommandClient,
    EngineCommandServer,
    MigrationEventPublisher,
    MigrationEventSubscriber,
    control_address,
    events_address,
)
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGE_SENT,
    DropStaging,
    EngineCommand,
    EngineCommandReply,
    ExportStage,
    MigrationEvent,
)


def test_addresses_derive_from_an_ipc_snapshot_socket(monkeypatch) -> None:
    monkeypatch.delenv("LLUMNIX_ENGINE_CONTROL_ADDR", raising=False)
    monkeypatch.delenv("LLUMNIX_ENGINE_EVENTS_ADDR", raising=False)
    assert control_address("ipc:///run/e.sock") == "ipc:///run/e.sock.ctl"
    assert events_address("ipc:///run/e.sock") == "ipc:///run/e.sock.events"
    with pytest.raises(ValueError, match="LLUMNIX_ENGINE_CONTROL_ADDR"):
        control_address("tcp://127.0.0.1:5555")
    assert control_address("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556") == "tcp://127.0.0.1:5556"
    monkeypatch.setenv("LLUMNIX_ENGINE_EVENTS_ADDR", "tcp://127.0.0.1:5557")
    assert events_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5557"


@pytest.fixture
def addr(tmp_path) -> str:
    return f"ipc://{tmp_path}/engine.sock.ctl"


def _stage(request_id: str) -> EngineCommand:
    return EngineCommand(
        schema_version=ENGINE_COMMAND_SCHEMA_VERSION,
        export_stage=ExportStage(migration_id="m1", request_id=request_id, kv_address="tcp://h:1"),
    )


async def test_commands_reach_the_handler_on_its_own_thread(addr) -> None:
    seen: list[tuple[str, str]] = []

    def handler(command: EngineCommand) -> EngineCommandReply:
        seen.append((command.WhichOneof("command"), threading.current_thread().name))
        if command.HasField("export_stage") and command.export_stage.request_id != "r1":
            return EngineCommandReply(ok=False, error="unknown request")
        if command.HasField("drop_staging"):
            raise RuntimeError("staging store is gone")
        return EngineCommandReply(ok=True)

    server = EngineCommandServer(addr, handler)
    client = EngineCommandClient(addr, timeout_s=5.0)
    try:
        assert (await client.send(_stage("r1"))).ok
        refused = await client.send(_stage("r2"))
        assert (refused.ok, refused.error) == (False, "unknown request")
        drop = DropStaging(migration_id="m")
        failed = await client.send(EngineCommand(schema_version=1, drop_staging=drop))
        assert not failed.ok and "staging store is gone" in failed.error
        newer = await client.send(EngineCommand(schema_version=7, drop_staging=drop))
        assert not newer.ok and "schema 7" in newer.error
    finally:
        client.close()
        server.close()
    assert [kind for kind, _ in seen] == ["export_stage", "export_stage", "drop_staging"]
    assert {thread for _, thread in seen} == {"llumnix-engine-commands"}


async def test_timeout_raises_and_the_next_command_still_works(addr) -> None:
    slow = threading.Event()

    def handler(command: EngineCommand) -> EngineCommandReply:
        if command.export_stage.request_id == "slow":
            slow.wait(2.0)
        return EngineCommandReply(ok=True, error=command.export_stage.request_id)

    server = EngineCommandServer(addr, handler)
    client = EngineCommandClient(addr, timeout_s=0.3)
    try:
        with pytest.raises(EngineChannelError, match="did not answer"):
            await client.send(_stage("slow"))
        slow.set()
        client.timeout_s = 5.0
        reply = await client.send(_stage("fast"))
        # The late reply to "slow" went to the discarded socket, not to this call.
        assert (reply.ok, reply.error) == (True, "fast")
    finally:
        client.close()
        server.close()


async def test_no_engine_means_a_timeout_not_a_hang(addr) -> None:
    client = EngineCommandClient(addr, timeout_s=0.2)
    with pytest.raises(EngineChannelError):
        await asyncio.wait_for(client.send(_stage("r1")), timeout=5.0)
    client.close()
    with pytest.raises(EngineChannelError, match="closed"):
        await client.send(_stage("r1"))


async def _probe_arrived(publisher: MigrationEventPublisher, subscriber: MigrationEventSubscriber) -> bool:
    publisher.publish(MigrationEvent(kind=MIGRATION_EVENT_KIND_STAGE_SENT, migration_id="probe"))
    event = await subscriber.receive(0.05)
    return event is not None


async def test_events_arrive_in_order_and_publish_never_blocks(tmp_path) -> None:
    addr = f"ipc://{tmp_path}/engine.sock.events"
    publisher = MigrationEventPublisher(addr)
    # No reader yet: publishing must return at once (the event is dropped or queued).
    publisher.publish(MigrationEvent(kind=MIGRATION_EVENT_KIND_STAGE_SENT, migration_id="early"))
    subscriber = MigrationEventSubscriber(addr)
    try:
        # Until the subscription is in place (ZMQ drops what is published before): probes until one arrives.
        deadline = time.monotonic() + 10.0
        while not await _probe_arrived(publisher, subscriber):
            assert time.monotonic() < deadline, "the subscriber never received an event"
        threads = [
            threading.Thread(
                target=lambda base=base: [
                    publisher.publish(MigrationEvent(kind=MIGRATION_EVENT_KIND_STAGE_SENT,
                                                     migration_id=f"m{base}", stage=stage))
                    for stage in range(1, 51)
                ]
            )
            for base in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stages: dict[str, list[int]] = {}

        async def collect() -> None:
            async for event in subscriber.events():
                if event.migration_id in ("early", "probe"):
                    continue
                stages.setdefault(event.migration_id, []).append(event.stage)
                if sum(map(len, stages.values())) == 150:
                    return

        await asyncio.wait_for(collect(), timeout=10)
        assert stages == {f"m{base}": list(range(1, 51)) for base in range(3)}
        assert await subscriber.receive(0.05) is None
    finally:
        subscriber.close()
        publisher.close()
