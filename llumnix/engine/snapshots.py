"""The local channel between an engine and its llumlet: `EngineSnapshot` messages (proto/llumnix/v1/
engine.proto) over a ZeroMQ PUB/SUB socket, normally `ipc://` on a path both containers share.

The subscriber returns only the newest message: a snapshot supersedes every older one, so a slow
reader never falls behind, and the publisher never blocks an engine step (it drops messages a slow
reader leaves queued). What a snapshot reports incrementally, the prefix cache's changes, is
merged over the messages read at once (`merge_updates`), so none is lost between them.
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq

from llumnix.engine.prefix_cache_report import merge_updates
from llumnix.v1.engine_pb2 import EngineSnapshot

SNAPSHOT_SCHEMA_VERSION = 1
SNAPSHOT_ADDR_ENV = "LLUMNIX_SNAPSHOT_ADDR"
"""Environment variable naming the socket address (e.g. ipc:///tmp/llumnix-engine-0.sock)."""


SEND_QUEUE_SNAPSHOTS = 64
"""Snapshots queued for a subscriber that is behind. A full PUB queue drops the *newest* message, so
a short queue turned a llumlet's brief stall into a stale load (the last steps of a burst lost until
the next idle refresh); the subscriber drains whatever is queued to the newest, so a backlog costs it
only the parsing."""


class SnapshotPublisher:
    """Engine side. `publish` never blocks: with no subscriber, or a full queue, the message drops."""

    def __init__(self, addr: str) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_SNAPSHOTS)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self.addr = addr

    def publish(self, snapshot: EngineSnapshot) -> None:
        with contextlib.suppress(zmq.Again):
            self._sock.send(snapshot.SerializeToString(), zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)


class SnapshotSubscriber:
    """llumlet side (asyncio). `receive` returns the newest snapshot, or None after `timeout_s`.

    It waits on the socket's file descriptor in the running loop and reads what is queued without
    blocking: pyzmq's asyncio socket builds a poller, futures and an exception for every read, which
    cost the llumlet more CPU than the snapshots themselves at an engine's step rate."""

    def __init__(self, addr: str) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(addr)
        self.addr = addr

    async def receive(self, timeout_s: float) -> EngineSnapshot | None:
        payloads = self._queued()
        if not payloads and await self._readable(timeout_s):
            payloads = self._queued()
        if not payloads:
            return None
        snapshot = self._parse(payloads[0])
        # The newest wins, carrying the prefix-cache changes of the ones it supersedes.
        for payload in payloads[1:]:
            newer = self._parse(payload)
            if snapshot.HasField("prefix_cache") and snapshot.engine_id == newer.engine_id:
                if newer.HasField("prefix_cache"):
                    newer.prefix_cache.CopyFrom(merge_updates(snapshot.prefix_cache, newer.prefix_cache))
                else:
                    newer.prefix_cache.CopyFrom(snapshot.prefix_cache)
            snapshot = newer
        return snapshot

    def _queued(self) -> list[bytes]:
        """Every message queued now, oldest first, without blocking."""
        payloads = []
        with contextlib.suppress(zmq.Again):
            while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                payloads.append(self._sock.recv(zmq.NOBLOCK))
        return payloads

    async def _readable(self, timeout_s: float) -> bool:
        """Waits until a message is queued (True) or `timeout_s` passed (False). ZeroMQ's descriptor
        only says that the socket's state may have changed, so each wake-up asks the socket again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        fd = self._sock.getsockopt(zmq.FD)
        while not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            woken: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _wake, woken)
            timer = loop.call_later(remaining, _wake, woken)
            try:
                await woken
            finally:
                loop.remove_reader(fd)
                timer.cancel()
        return True

    @staticmethod
    def _parse(payload: bytes) -> EngineSnapshot:
        snapshot = EngineSnapshot.FromString(payload)
        if snapshot.schema_version != SNAPSHOT_SCHEMA_VERSION:
            raise ValueError(
                f"engine snapshot schema {snapshot.schema_version} is not {SNAPSHOT_SCHEMA_VERSION}"
            )
        return snapshot

    def close(self) -> None:
        self._sock.close(linger=0)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
