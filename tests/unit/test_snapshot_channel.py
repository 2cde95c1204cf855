"""The engine -> llumlet snapshot channel: newest snapshot wins, unknown schemas are refused."""

import asyncio
import time

import pytest

from llumlet.snapshots import SnapshotPublisher, SnapshotSubscriber
from llumnix.v1.engine_pb2 import EngineSnapshot


@pytest.fixture
def channel(tmp_path):
    addr = f"ipc://{tmp_path}/snap.sock"
    publisher, subscriber = SnapshotPublisher(addr), SnapshotSubscriber(addr)
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


async def test_receive_returns_the_newest_snapshot(channel) -> None:
    publisher, subscriber = channel
    await asyncio.sleep(0.2)  # let the subscription reach the publisher
    for step in range(50):
        publisher.publish(EngineSnapshot(schema_version=1, step=step))
        time.sleep(0.001)
    await asyncio.sleep(0.1)
    snapshot = await subscriber.receive(1.0)
    assert snapshot is not None and snapshot.step == 49
    assert await subscriber.receive(0.05) is None


async def test_unknown_schema_is_refused(channel) -> None:
    publisher, subscriber = channel
    await asyncio.sleep(0.2)
    publisher.publish(EngineSnapshot(schema_version=99, step=1))
    with pytest.raises(ValueError, match="schema 99"):
        await subscriber.receive(1.0)
