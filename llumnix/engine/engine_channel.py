"""The local control channel between a llumlet and its engine for live migration (ZeroMQ, messages of
proto/llumnix/v1/kv_transfer.proto), next to the snapshot socket of llumnix/engine/snapshots.py:

- commands: the llumlet's `EngineCommandClient` (REQ, asyncio) -> the engine's `EngineCommandServer`
  (REP, bound by the connector's scheduler side, answered on a daemon thread);
- events: the engine's `MigrationEventPublisher` (PUSH, bound; `publish` never blocks an engine step)
  -> the llumlet's `MigrationEventSubscriber` (PULL, asyncio).

For an `ipc://X` snapshot socket the control socket is `ipc://X.ctl` and the events socket
`ipc://X.events`; other transports need explicit addresses (environment or connector extra config).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from llumnix.v1.kv_transfer_pb2 import EngineCommand, EngineCommandReply, MigrationEvent

ENGINE_COMMAND_SCHEMA_VERSION = 1
CONTROL_ADDR_ENV = "LLUMNIX_ENGINE_CONTROL_ADDR"
EVENTS_ADDR_ENV = "LLUMNIX_ENGINE_EVENTS_ADDR"
# Events queued for a slow or absent llumlet before new ones are dropped (the engine never waits).
_EVENT_QUEUE = 10_000
_POLL_MS = 100


class EngineChannelError(RuntimeError):
    """The engine did not answer a command in time (or the channel is closed)."""


def _derived_address(snapshot_addr: str, suffix: str, override: str | None, env: str) -> str:
    explicit = override or os.environ.get(env)
    if explicit:
        return explicit
    if not snapshot_addr.startswith("ipc://"):
        raise ValueError(
            f"cannot derive the engine's {suffix.lstrip('.')} socket from the non-ipc snapshot address "
            f"{snapshot_addr!r}: set {env} (or the connector's extra config) to an explicit address"
        )
    return snapshot_addr + suffix


def control_address(snapshot_addr: str, override: str | None = None) -> str:
    """The command socket: `override`, else $LLUMNIX_ENGINE_CONTROL_ADDR, else `<ipc snapshot addr>.ctl`."""
    return _derived_address(snapshot_addr, ".ctl", override, CONTROL_ADDR_ENV)


def events_address(snapshot_addr: str, override: str | None = None) -> str:
    """The event socket: `override`, else $LLUMNIX_ENGINE_EVENTS_ADDR, else `<ipc snapshot addr>.events`."""
    return _derived_address(snapshot_addr, ".events", override, EVENTS_ADDR_ENV)


def _refusal(error: str) -> EngineCommandReply:
    return EngineCommandReply(ok=False, error=error)


class EngineCommandServer:
    """Engine side: answers each command with `handler`'s reply on a daemon thread.

    A handler exception becomes ok=false with the error; a command of an unknown schema version is
    refused without reaching the handler.
    """

    def __init__(self, addr: str, handler: Callable[[EngineCommand], EngineCommandReply]) -> None:
        self.addr = addr
        self._handler = handler
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)  # here, so a bad address fails the caller, not the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="llumnix-engine-commands", daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> EngineCommandReply:
        try:
            command = EngineCommand.FromString(payload)
        except Exception as exc:  # a malformed message is the peer's error, reported to it
            return _refusal(f"malformed engine command: {exc}")
        if command.schema_version != ENGINE_COMMAND_SCHEMA_VERSION:
            return _refusal(
                f"engine command schema {command.schema_version} is not {ENGINE_COMMAND_SCHEMA_VERSION}"
            )
        try:
            return self._handler(command)
        except Exception as exc:  # every failure is reported to the llumlet
            return _refusal(f"{type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(_POLL_MS):
                    continue
                reply = self._answer(self._sock.recv())
                self._sock.send(reply.SerializeToString())
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class EngineCommandClient:
    """llumlet side (asyncio). One command at a time; a timeout raises `EngineChannelError` and resets
    the REQ socket so the next command works (a REQ socket that lost its reply is otherwise stuck)."""

    def __init__(self, addr: str, timeout_s: float = 5.0) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._lock = asyncio.Lock()
        self._sock: zmq.asyncio.Socket | None = None
        self._closed = False
        self._connect()

    def _connect(self) -> None:
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.addr)

    async def send(self, command: EngineCommand) -> EngineCommandReply:
        if not command.schema_version:
            command.schema_version = ENGINE_COMMAND_SCHEMA_VERSION
        async with self._lock:
            if self._closed or self._sock is None:
                raise EngineChannelError(f"engine command channel {self.addr} is closed")
            await self._sock.send(command.SerializeToString())
            if not await self._sock.poll(timeout=int(self.timeout_s * 1000)):
                self._sock.close(linger=0)
                self._connect()
                raise EngineChannelError(
                    f"the engine did not answer on {self.addr} within {self.timeout_s:g} s"
                )
            return EngineCommandReply.FromString(await self._sock.recv())

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class MigrationEventPublisher:
    """Engine side. Thread-safe; `publish` never blocks: without a reader, or with a full queue, the
    event is dropped (the llumlet also learns outcomes from snapshots and its own timeouts)."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._lock = threading.Lock()
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _EVENT_QUEUE)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self.dropped = 0

    def publish(self, event: MigrationEvent) -> None:
        payload = event.SerializeToString()
        with self._lock:
            try:
                self._sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)


class MigrationEventSubscriber:
    """llumlet side (asyncio): `async for event in subscriber.events()`."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)

    async def receive(self, timeout_s: float) -> MigrationEvent | None:
        """The next event, or None after `timeout_s`."""
        if not await self._sock.poll(timeout=int(timeout_s * 1000)):
            return None
        return MigrationEvent.FromString(await self._sock.recv())

    async def events(self) -> AsyncIterator[MigrationEvent]:
        """Every event until `close()`."""
        while not self._sock.closed:
            try:
                payload = await self._sock.recv()
            except zmq.ZMQError:
                if self._sock.closed:
                    return
                raise
            yield MigrationEvent.FromString(payload)

    def close(self) -> None:
        self._sock.close(linger=0)
