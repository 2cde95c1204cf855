"""Engine state -> `EngineSnapshot` (proto/llumnix/v1/engine.proto), as pure functions.

The connector captures an `EngineState` on the engine's scheduler thread (cheap: one tuple per
request) and a background thread turns it into the protobuf message (`build_snapshot`), so the costly
part stays off the engine step. Nothing here imports vLLM: the sim engine and the tests use it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from llumnix.engine.snapshots import SNAPSHOT_SCHEMA_VERSION
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot


class RequestRow(NamedTuple):
    """One request as the engine holds it at capture time. `capture_rows` builds these with
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


_new_row = tuple.__new__


def capture_rows(
    tracked: Iterable[tuple[str, tuple[str, Any]]],
    scheduled: Mapping[str, int],
    blocks_of: Callable[[str], int],
    running_status: object,
    preempted_status: object,
) -> list[RequestRow]:
    """Rows for `(engine id, (llumlet id, request))` pairs of vLLM `Request`s (duck-typed).

    `scheduled` holds the tokens scheduled this step: their KV is valid once the step's forward ran,
    which is when the llumlet reads the snapshot.
    """
    return [
        _new_row(RequestRow, (
            key,
            engine_id,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.num_computed_tokens + scheduled.get(engine_id, 0),
            blocks_of(engine_id),
            bool((req.kv_transfer_params or {}).get("high_priority")),
            req.arrival_time,
            req.status != running_status,
            req.status == preempted_status,
        ))
        for engine_id, (key, req) in tracked
    ]


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
