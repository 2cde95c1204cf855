import time
from pathlib import Path

from waiting import wait_until

from llumnix.engine.engine_snapshot import EngineState, RequestRow
from llumnix.engine.snapshot_pump import SnapshotPump
from llumnix.engine.snapshots import SnapshotPublisher, SnapshotSubscriber


def state(free: int, running: int = 0) -> EngineState:
    rows = [RequestRow(f"r{i}", f"e{i}", 10, 1, 11, 1, False, 0.0, False, False) for i in range(running)]
    return EngineState(time.time(), 100, free, 0, rows)


async def receive_until(subscriber: SnapshotSubscriber, predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snapshot = await subscriber.receive(0.5)
        if snapshot is not None and predicate(snapshot):
            return snapshot
    raise AssertionError("no matching snapshot arrived")


async def test_submitted_states_and_idle_refreshes_are_published(tmp_path: Path):
    addr = f"ipc://{tmp_path}/engine.sock"
    idle_state = {"value": state(free=100)}
    pump = SnapshotPump(SnapshotPublisher(addr), "engine-0", 32, lambda: idle_state["value"],
                        idle_refresh_s=0.05)
    subscriber = SnapshotSubscriber(addr)
    try:
        # Nothing submitted: the idle refresh alone keeps snapshots coming (and reaches a late joiner).
        first = await receive_until(subscriber, lambda s: s.free_blocks == 100)
        assert first.engine_id == "engine-0" and first.block_size == 32

        pump.submit(state(free=90, running=2))
        busy = await receive_until(subscriber, lambda s: s.free_blocks == 90)
        assert len(busy.running) == 2 and busy.step > first.step

        idle_state["value"] = state(free=97)  # e.g. the last request finished, then the engine idled
        after = await receive_until(subscriber, lambda s: s.free_blocks == 97)
        assert after.step > busy.step
    finally:
        subscriber.close()
        pump.close()


async def test_capture_error_skips_a_refresh_without_killing_the_pump(tmp_path: Path):
    addr = f"ipc://{tmp_path}/engine.sock"
    calls = {"n": 0}

    def flaky_capture() -> EngineState:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return state(free=55)

    pump = SnapshotPump(SnapshotPublisher(addr), "e", 32, flaky_capture, idle_refresh_s=0.05)
    subscriber = SnapshotSubscriber(addr)
    try:
        assert (await receive_until(subscriber, lambda s: s.free_blocks == 55)).free_blocks == 55
        assert calls["n"] >= 2
    finally:
        subscriber.close()
        pump.close()


async def test_close_stops_publishing(tmp_path: Path):
    addr = f"ipc://{tmp_path}/engine.sock"
    pump = SnapshotPump(SnapshotPublisher(addr), "e", 32, lambda: state(free=1), idle_refresh_s=0.02)
    try:
        await wait_until(lambda: pump.published > 0, "the pump's first idle refresh")
    finally:
        pump.close()
    published = pump.published
    # close() joins the publishing thread: with it gone nothing can publish again (no window to wait out).
    assert not pump._thread.is_alive()
    assert published > 0 and pump.published == published
