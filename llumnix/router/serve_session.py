"""The router's data path to one llumlet: one `Serve` stream (proto/llumnix/v1/llumlet.proto) that
carries every request the router runs there. Commands go out in order; each batch of events that
comes back is handed to the requests it names, so a request's task wakes once per batch rather than
once per token, and a gRPC message carries a whole engine step rather than one token.

The stream opens on first use and again after it broke; when it breaks, every request on it fails
with `InstanceStreamDown` (the instance's failure: the request can go elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from llumnix.service_token import CallMetadata
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc


class InstanceStreamDown(Exception):
    """The Serve stream to the instance broke (llumlet gone, connection lost) or ended early."""


class RequestStream:
    """One request's events as they arrive; `close()` aborts it if it has not ended."""

    __slots__ = ("_error", "_events", "_session", "_waiter", "ended", "request_id")

    def __init__(self, session: ServeSession, request_id: str) -> None:
        self._session = session
        self.request_id = request_id
        self._events: list[pb.ServeEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: InstanceStreamDown | None = None
        self.ended = False
        """Its last event (finished, moved, failure) arrived, or the stream broke."""

    def _push(self, event: pb.ServeEvent, last: bool) -> None:
        self._events.append(event)
        self.ended = self.ended or last
        self._wake()

    def _fail(self, error: InstanceStreamDown) -> None:
        self._error = error
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_events(self) -> list[pb.ServeEvent]:
        """The events that arrived since the last call (waits for at least one); raises
        `InstanceStreamDown` once they are read and the stream broke."""
        while not self._events:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self._session.abort(self.request_id)


class ServeSession:
    def __init__(self, stub: llumlet_pb2_grpc.LlumletStub, metadata: CallMetadata = ()) -> None:
        """`metadata`: what the stream presents (the service token, `llumnix.service_token`)."""
        self._stub = stub
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall[pb.ServeCommand, pb.ServeEvents] | None = None
        self._commands: asyncio.Queue[pb.ServeCommand] = asyncio.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._tasks: tuple[asyncio.Task[None], ...] = ()

    def start(self, request: pb.GenerateRequest) -> RequestStream:
        """Sends the request (a new one, or an attach) and returns its events."""
        if self._call is None:
            self._open()
        stream = self._streams[request.request_id] = RequestStream(self, request.request_id)
        self._commands.put_nowait(pb.ServeCommand(generate=request))
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put_nowait(pb.ServeCommand(abort=pb.AbortRequest(request_id=request_id)))

    def _open(self) -> None:
        # A fresh queue and request table per stream: what was meant for a broken stream stays there.
        self._commands = asyncio.Queue()
        self._streams = {}
        call = self._call = self._stub.Serve(metadata=self._metadata)
        self._tasks = (asyncio.create_task(_write(call, self._commands), name="serve-commands"),
                       asyncio.create_task(self._read(call, self._streams), name="serve-events"))

    async def _read(self, call: grpc.aio.StreamStreamCall[pb.ServeCommand, pb.ServeEvents],
                    streams: dict[str, RequestStream]) -> None:
        error = InstanceStreamDown("the llumlet ended the stream")
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                for event in batch.events:  # type: ignore[union-attr]
                    stream = streams.get(event.request_id)
                    if stream is None:
                        continue  # aborted here already
                    last = not event.HasField("chunk")
                    if last:
                        del streams[event.request_id]
                    stream._push(event, last)
        except grpc.aio.AioRpcError as exc:
            error = InstanceStreamDown(f"{exc.code().name}: {exc.details()}")
        finally:
            if self._call is call:
                self._call = None
            call.cancel()  # stops the command writer
            for stream in streams.values():
                stream._fail(error)
            streams.clear()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _write(call: grpc.aio.StreamStreamCall[pb.ServeCommand, pb.ServeEvents],
                 commands: asyncio.Queue[pb.ServeCommand]) -> None:
    """Sends the commands in order (gRPC takes one write at a time) until the stream ends."""
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        while True:
            await call.write(await commands.get())
