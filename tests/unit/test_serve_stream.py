"""The llumlet's side of `Serve` (llumlet/serve_stream.py) over a scripted admission path: events of
several requests batched together in order per request, failures and finishes ending each request,
aborts stopping only their request, messages capped in size, and the end of the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from llumlet.admission import AdmissionError, StreamEvent
from llumlet.serve_stream import MAX_BATCH_BYTES, ServeStream
from llumnix.openai_stream import GenerationChunk
from llumnix.v1 import llumlet_pb2 as pb

TIMEOUT_S = 10.0


class ScriptedRequests:
    """Each request yields three tokens at once and finishes; "fail-*" requests are refused, "big-*"
    ones send one token with 100,000 prompt token ids (~300 kB) and finish, "hold-*" ones send one token
    and then wait until aborted. Every request's close is recorded; `started` is set per request
    once its first event is out."""

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.started: dict[str, asyncio.Event] = {}

    async def events(self, request: pb.GenerateRequest) -> AsyncIterator[StreamEvent]:
        request_id = request.request_id
        started = self.started.setdefault(request_id, asyncio.Event())
        if request_id.startswith("fail-"):
            raise AdmissionError.of(503, "this instance is draining", "ServiceUnavailableError")
        try:
            if request_id.startswith("big-"):
                yield StreamEvent({}, [GenerationChunk(token_ids=(0,), finish_reason="length",
                                                       prompt_token_ids=tuple(range(100_000)))])
                return
            if request_id.startswith("hold-"):
                yield StreamEvent({}, [GenerationChunk(token_ids=(0,), text=f"{request_id}:0")])
                started.set()
                await asyncio.Event().wait()
            for token in range(3):
                yield StreamEvent({}, [GenerationChunk(token_ids=(token,), text=f"{request_id}:{token}",
                                                       finish_reason="length" if token == 2 else None)])
        finally:
            self.closed.append(request_id)


def generate(request_id: str) -> pb.ServeCommand:
    return pb.ServeCommand(generate=pb.GenerateRequest(request_id=request_id,
                                                       endpoint=pb.ENDPOINT_COMPLETION, body_json="{}"))


async def run(requests: ScriptedRequests, commands: list[pb.ServeCommand],
              abort_once_started: str | None = None) -> list[list[pb.ServeEvent]]:
    """Sends the commands (and, once that request has started, an abort of `abort_once_started`),
    then hangs up its side, and returns the batches until the stream ends."""
    queue: asyncio.Queue[pb.ServeCommand | None] = asyncio.Queue()
    for command in commands:
        queue.put_nowait(command)

    async def command_iterator() -> AsyncIterator[pb.ServeCommand]:
        while (command := await queue.get()) is not None:
            yield command

    stream = ServeStream(requests.events)
    reader = asyncio.create_task(stream.read_commands(command_iterator()))
    batches: list[list[pb.ServeEvent]] = []

    async def collect() -> None:
        async for batch in stream.batches():
            batches.append(list(batch.events))

    collector = asyncio.create_task(collect())
    if abort_once_started is not None:
        started = requests.started.setdefault(abort_once_started, asyncio.Event())
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        queue.put_nowait(pb.ServeCommand(abort=pb.AbortRequest(request_id=abort_once_started)))
    queue.put_nowait(None)
    await asyncio.wait_for(collector, TIMEOUT_S)
    await reader
    await stream.close()
    return batches


def per_request(batches: list[list[pb.ServeEvent]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for event in (e for batch in batches for e in batch):
        kind = event.WhichOneof("event")
        out.setdefault(event.request_id, []).append(event.chunk.text if kind == "chunk" else kind)
    return out


async def test_requests_events_come_batched_in_order_and_end_with_finished() -> None:
    batches = await run(ScriptedRequests(), [generate("a"), generate("b"), generate("c")])
    assert per_request(batches) == {r: [f"{r}:0", f"{r}:1", f"{r}:2", "finished"] for r in "abc"}
    assert max(len(batch) for batch in batches) >= 3, "one step's tokens of every request in one message"


async def test_a_refused_request_ends_with_its_failure_and_others_go_on() -> None:
    batches = await run(ScriptedRequests(), [generate("a"), generate("fail-x")])
    events = [e for batch in batches for e in batch]
    failure = next(e.failure for e in events if e.request_id == "fail-x")
    assert failure.status == 503 and "draining" in failure.body_json
    assert per_request(batches)["a"][-1] == "finished"


async def test_a_duplicate_id_on_the_stream_is_refused_with_409() -> None:
    batches = await run(ScriptedRequests(), [generate("a"), generate("a")])
    events = [e for batch in batches for e in batch if e.request_id == "a"]
    assert [e.failure.status for e in events if e.HasField("failure")] == [409]
    assert per_request(batches)["a"][-1] == "finished"


async def test_an_abort_stops_only_its_request_and_closes_its_events() -> None:
    requests = ScriptedRequests()
    batches = await run(requests, [generate("hold-a"), generate("b")], abort_once_started="hold-a")
    result = per_request(batches)
    assert result["hold-a"] == ["hold-a:0"], "nothing is sent for an aborted request, not even an end"
    assert result["b"][-1] == "finished"
    assert "hold-a" in requests.closed


async def test_closing_the_stream_aborts_every_request_on_it() -> None:
    requests = ScriptedRequests()
    stream = ServeStream(requests.events)

    async def commands() -> AsyncIterator[pb.ServeCommand]:
        yield generate("hold-a")
        yield generate("hold-b")
        await asyncio.Event().wait()  # the caller says nothing more and never hangs up

    reader = asyncio.create_task(stream.read_commands(commands()))
    for request_id in ("hold-a", "hold-b"):
        await asyncio.wait_for(requests.started.setdefault(request_id, asyncio.Event()).wait(), TIMEOUT_S)
    reader.cancel()
    await asyncio.wait_for(stream.close(), TIMEOUT_S)
    assert sorted(requests.closed) == ["hold-a", "hold-b"]


@pytest.mark.timeout(60)
async def test_a_large_backlog_goes_in_messages_under_the_cap() -> None:
    batches = await run(ScriptedRequests(), [generate(f"big-{i}") for i in range(8)])
    events = [event for batch in batches for event in batch]
    assert sum(event.HasField("chunk") for event in events) == 8
    largest_event = max(event.ByteSize() for event in events)
    assert largest_event > 250_000
    assert len(batches) > 1
    # A message ends with the event that crossed the cap: at most one event over it.
    assert all(pb.ServeEvents(events=batch).ByteSize() < MAX_BATCH_BYTES + largest_event + 16
               for batch in batches)
