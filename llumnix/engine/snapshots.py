"""The local channel between an engine and its llumlet: `EngineSnapshot` messages (proto/llumnix/v1/
engine.proto) over a ZeroMQ PUB/SUB socket, normally `ipc://` on a path both containers share.

The subscriber returns only the newest message: a snapshot supersedes every older one, so a slow
reader never falls behind, and the publisher never blocks an engine step (it drops messages a slow
reader leaves queued). What a snapshot reports incrementally, the prefix cache's changes, is
merged over the messages read at once (`merge_updates`), so none is lost between them.
"""

from __future__ import annotations

import contextlib

import zmq
import zmq.asyncio

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
    """llumlet side (asyncio). `receive` returns the newest snapshot, or None after `timeout_s`."""

    def __init__(self, addr: str) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(addr)
        self.addr = addr

    async def receive(self, timeout_s: float) -> EngineSnapshot | None:
        if not await self._sock.poll(timeout=int(timeout_s * 1000)):
            return None
        snapshot = self._parse(await self._sock.recv())
        # Drain to the newest, carrying the prefix-cache changes of the ones it supersedes.
        while True:
            try:
                newer = self._parse(self._sock.recv(zmq.NOBLOCK).result())
            except zmq.Again:
                break
            if snapshot.HasField("prefix_cache") and snapshot.engine_id == newer.engine_id:
                if newer.HasField("prefix_cache"):
                    newer.prefix_cache.CopyFrom(merge_updates(snapshot.prefix_cache, newer.prefix_cache))
                else:
                    newer.prefix_cache.CopyFrom(snapshot.prefix_cache)
            snapshot = newer
        return snapshot

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
