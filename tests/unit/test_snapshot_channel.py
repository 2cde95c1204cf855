"""The engine -> llumlet snapshot channel: newest snapshot wins, unknown schemas are refused."""

import asyncio
import time

import pytest

from llumnix.engine.snapshots import SnapshotPublisher, SnapshotSubscriber
from llumnix.v1.engine_pb2 import EngineSnapshot


@pytest.fixture
async def channel(tmp_path):
    addr = f"ipc://{tmp_path}/snap.sock"
    publisher, subscriber = SnapshotPublisher(addr), SnapshotSubscriber(addr)
    # Wait until the subscription has reached the publisher (ZeroMQ's slow joiner).
    deadline = time.monotonic() + 10
    while await subscriber.receive(0.05) is None:
        assert time.monotonic() < deadline, "the subscriber never connected"
        publisher.publish(EngineSnapshot(schema_version=1, step=0))
    while await subscriber.receive(0.05) is not None:
        pass
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


async def test_receive_skips_to_the_newest_snapshot(channel) -> None:
    publisher, subscriber = channel
    for step in range(1, 51):
        publisher.publish(EngineSnapshot(schema_version=1, step=step))
        time.sleep(0.001)
    await asyncio.sleep(0.3)
    seen = []
    deadline = time.monotonic() + 10
    while not seen or seen[-1] != 50:
        assert time.monotonic() < deadline, f"never saw the last snapshot; saw {seen}"
        snapshot = await subscriber.receive(1.0)
        if snapshot is not None:
            seen.append(snapshot.step)
    assert seen == sorted(set(seen)), "an older snapshot came after a newer one"
    assert len(seen) <= 5, f"stale snapshots were delivered one by one: {seen}"


async def test_unknown_schema_is_refused(channel) -> None:
    publisher, subscriber = channel
    publisher.publish(EngineSnapshot(schema_version=99, step=1))
    with pytest.raises(ValueError, match="schema 99"):
        await subscriber.receive(5.0)
