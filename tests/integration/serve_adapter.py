"""For fake llumlets in tests: serve the router's `Serve` stream from a per-request `Generate`
implementation, one request at a time (what these tests send)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from llumnix.v1 import llumlet_pb2 as pb

Generate = Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]


async def serve_from_generate(commands: AsyncIterator[pb.ServeCommand], generate: Generate
                              ) -> AsyncIterator[pb.ServeEvents]:
    async for command in commands:
        if not command.HasField("generate"):
            continue
        request_id = command.generate.request_id
        moved = False
        async for response in generate(command.generate):
            if response.HasField("moved"):
                moved = True
                event = pb.ServeEvent(request_id=request_id, moved=response.moved)
            else:
                event = pb.ServeEvent(request_id=request_id, chunk=response.chunk)
            yield pb.ServeEvents(events=[event])
        if not moved:
            yield pb.ServeEvents(events=[pb.ServeEvent(request_id=request_id, finished=True)])
