"""Engine state -> `EngineSnapshot` (proto/llumnix/v1/engine.proto), as pure functions.

The connector captures an `EngineState` on the engine's scheduler thread (cheap: one tuple per
request) and a background thread turns it into the protobuf message (`build_snapshot`), so the costly
part stays off the engine step. Nothing here imports vLLM: the sim engine and the tests use it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from llumlet.snapshots import SNAPSHOT_SCHEMA_VERSION
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot


class RequestRow(NamedTuple):
    """One request as the engine holds it at capture time. The hot path builds these with
    `tuple.__new__(RequestRow, ...)`, which skips NamedTuple's slower constructor."""

    request_id: str
    engine_request_id: str
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    blocks: int
    high_priority: bool
    arrival_time: float
    queued: bool
    # Preempted requests go back to the head of vLLM's waiting queue.
    preempted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class EngineState:
    timestamp: float
    total_blocks: int
    free_blocks: int
    preemptions_total: int
    requests: Sequence[RequestRow]


def waiting_order(rows: Sequence[RequestRow]) -> list[RequestRow]:
    """Queued requests in vLLM's FCFS queue order: preempted ones first, then by arrival."""
    return sorted((r for r in rows if r.queued), key=lambda r: (not r.preempted, r.arrival_time))


def _to_proto(row: RequestRow) -> EngineRequest:
    return EngineRequest(
        request_id=row.request_id,
        engine_request_id=row.engine_request_id,
        prompt_tokens=row.prompt_tokens,
        output_tokens=row.output_tokens,
        computed_tokens=row.computed_tokens,
        blocks=row.blocks,
        high_priority=row.high_priority,
        arrival_time=row.arrival_time,
    )


def build_snapshot(engine_id: str, step: int, block_size: int, state: EngineState) -> EngineSnapshot:
    return EngineSnapshot(
        schema_version=SNAPSHOT_SCHEMA_VERSION,
        engine_id=engine_id,
        step=step,
        timestamp=state.timestamp,
        total_blocks=state.total_blocks,
        free_blocks=state.free_blocks,
        block_size=block_size,
        running=[_to_proto(r) for r in state.requests if not r.queued],
        waiting=[_to_proto(r) for r in waiting_order(state.requests)],
        preemptions_total=state.preemptions_total,
    )
