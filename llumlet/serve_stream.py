"""One caller's `Serve` stream (proto/llumnix/v1/llumlet.proto): the requests it started, each run as a
task over the shared admission path, and their events waiting to be sent.

Events are sent in batches of whatever is ready when the stream can take the next message: one
engine step's tokens for every request cross in one message while the caller keeps up, and more
pile into each message when it falls behind, so the per-message cost shrinks as load grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

from llumlet.admission import AdmissionError, StreamEvent
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.wire import chunk_to_proto

logger = logging.getLogger("llumlet.serve")

MAX_BATCH_BYTES = 1 << 20
"""A message stays well under gRPC's default 4 MiB receive limit (first chunks carry every prompt token
id): a longer backlog goes in several messages."""

RequestEvents = Callable[[pb.GenerateRequest], AsyncIterator[StreamEvent]]


class ServeStream:
    def __init__(self, request_events: RequestEvents) -> None:
        self._request_events = request_events
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[pb.ServeEvent] = []
        self._ready = asyncio.Event()
        self._commands_ended = False

    async def read_commands(self, commands: AsyncIterator[pb.ServeCommand]) -> None:
        """Starts and aborts requests as the caller says; once the caller has no more to say, the
        stream ends when its last request does."""
        async for command in commands:
            if command.HasField("generate"):
                self._start(command.generate)
            elif command.HasField("abort"):
                task = self._tasks.get(command.abort.request_id)
                if task is not None:
                    task.cancel()
        self._commands_ended = True
        self._ready.set()

    def _start(self, request: pb.GenerateRequest) -> None:
        request_id = request.request_id
        if request_id in self._tasks:
            self._fail(request_id, AdmissionError.of(
                409, f"request id {request_id!r} is already running on this stream", "ConflictError"))
            return
        self._tasks[request_id] = asyncio.create_task(self._run(request), name=f"serve {request_id}")

    async def _run(self, request: pb.GenerateRequest) -> None:
        request_id = request.request_id
        moved = False
        try:
            async with contextlib.aclosing(self._request_events(request)) as events:
                async for event in events:
                    if event.moved is not None:
                        moved = True
                        self._emit(pb.ServeEvent(request_id=request_id, moved=pb.Moved(
                            instance_id=event.moved.instance_id, address=event.moved.address,
                            request_id=event.moved.request_id, migration_id=event.moved.migration_id)))
                    else:
                        for chunk in event.chunks:
                            message = pb.ServeEvent(request_id=request_id)
                            chunk_to_proto(chunk, message.chunk)
                            self._emit(message)
            if not moved:
                self._emit(pb.ServeEvent(request_id=request_id, finished=True))
        except AdmissionError as exc:
            self._fail(request_id, exc)
        except Exception:
            # A defect here must still end the request for its caller, who would otherwise wait forever.
            logger.exception("request failed in the llumlet", extra={"request_id": request_id})
            self._fail(request_id, AdmissionError.of(500, "the llumlet failed serving the request"))
        finally:
            # Cancelled (the caller aborted it, or the stream ended): nothing more is sent for it.
            self._tasks.pop(request_id, None)
            self._ready.set()

    def _emit(self, event: pb.ServeEvent) -> None:
        self._outbox.append(event)
        self._ready.set()

    def _fail(self, request_id: str, error: AdmissionError) -> None:
        self._emit(pb.ServeEvent(request_id=request_id, failure=pb.RequestFailure(
            status=error.status, body_json=json.dumps(error.body))))

    async def batches(self) -> AsyncIterator[pb.ServeEvents]:
        """Every event, batched; ends once the caller stopped sending commands and no request runs."""
        while True:
            if self._outbox:
                yield pb.ServeEvents(events=self._take_batch())
                continue
            if self._commands_ended and not self._tasks:
                return
            self._ready.clear()
            await self._ready.wait()

    def _take_batch(self) -> list[pb.ServeEvent]:
        count = size = 0
        while count < len(self._outbox) and size < MAX_BATCH_BYTES:
            size += self._outbox[count].ByteSize()
            count += 1
        batch, self._outbox = self._outbox[:count], self._outbox[count:]
        return batch

    async def close(self) -> None:
        """The stream is gone: abort every request it started."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

