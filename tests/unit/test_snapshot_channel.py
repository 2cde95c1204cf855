"""The engine -> llumlet snapshot channel: newest snapshot wins, unknown schemas are refused."""

import asyncio
import time

import pytest
import zmq

from llumnix.engine.snapshots import SnapshotPublisher, SnapshotSubscriber
from llumnix.v1.engine_pb2 import EngineSnapshot


@pytest.fixture
async def channel(tmp_path):
    addr = f"ipc://{tmp_path}/snap.sock"
    publisher, subscriber = SnapshotPublisher(addr), SnapshotSubscriber(addr)
    await _connected(subscriber, publisher.publish)
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


async def _connected(subscriber: SnapshotSubscriber, publish) -> None:
    """Publishes step 0 until the subscription has reached the publisher (ZeroMQ's slow joiner), then
    a fence, and reads up to it: the channel is in order, so no probe is left behind it."""
    deadline = time.monotonic() + 10
    while await subscriber.receive(0.05) is None:
        assert time.monotonic() < deadline, "the subscriber never connected"
        publish(EngineSnapshot(schema_version=1, step=0))
    publish(EngineSnapshot(schema_version=1, step=0, engine_id="fence"))
    while (snapshot := await subscriber.receive(1.0)) is None or snapshot.engine_id != "fence":
        assert time.monotonic() < deadline, "the fence after the connection probes never arrived"


async def test_receive_skips_to_the_newest_snapshot() -> None:
    """A backlog of 50 snapshots is read as one: the newest. Over ipc the test could not know when the
    backlog has crossed the socket; over inproc (same ZeroMQ context as the subscriber's) a message is
    in the subscriber's queue once `send` returns, so the backlog is all there before the read."""
    addr = "inproc://llumnix-test-snapshots"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(addr)
    subscriber = SnapshotSubscriber(addr)
    try:
        await _connected(subscriber, lambda snapshot: publisher.send(snapshot.SerializeToString()))
        for step in range(1, 51):
            publisher.send(EngineSnapshot(schema_version=1, step=step).SerializeToString())
        newest = await subscriber.receive(5.0)
        assert newest is not None and newest.step == 50, f"stale snapshot delivered: {newest}"
        assert await subscriber.receive(0) is None, "a superseded snapshot was left queued"
    finally:
        subscriber.close()
        publisher.close()


async def test_snapshots_over_ipc_arrive_newest_last(channel) -> None:
    """Over the real transport: whatever the reader's pace, it never gets an older snapshot after a
    newer one, and it gets the last one."""
    publisher, subscriber = channel
    for step in range(1, 51):
        publisher.publish(EngineSnapshot(schema_version=1, step=step))
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while not seen or seen[-1] != 50:
        assert time.monotonic() < deadline, f"never saw the last snapshot; saw {seen}"
        snapshot = await subscriber.receive(1.0)
        if snapshot is not None:
            seen.append(snapshot.step)
    assert seen == sorted(set(seen)), f"an older snapshot came after a newer one: {seen}"


async def test_unknown_schema_is_refused(channel) -> None:
    publisher, subscriber = channel
    publisher.publish(EngineSnapshot(schema_version=99, step=1))
    with pytest.raises(ValueError, match="schema 99"):
        await subscriber.receive(5.0)


async def test_a_waiting_receive_wakes_on_the_snapshot_not_its_timeout(channel) -> None:
    """The reader waits on the socket's descriptor: a snapshot published while it waits ends the wait.
    Without the wake-up it would still return the snapshot, but only once its 30 s timeout ran out."""
    publisher, subscriber = channel
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(subscriber.receive(30.0))
    await asyncio.sleep(0)  # the task runs until it waits: nothing is queued yet
    assert not waiting.done()
    started = loop.time()
    publisher.publish(EngineSnapshot(schema_version=1, step=7))
    snapshot = await asyncio.wait_for(waiting, 60)
    assert snapshot is not None and snapshot.step == 7
    assert loop.time() - started < 20, "the wait ended by its timeout, not by the snapshot"
