"""A committed migration's downtime in its parts (docs/migration.md, "Where the downtime goes")."""

from __future__ import annotations

from llumnix.v1 import migration_pb2 as mpb

DOWNTIME_PARTS = ("source_stop", "source_kv", "source_event", "commit_transit", "destination")
"""In the order they happen; together they are the downtime."""


def downtime_parts(answer: mpb.MigrateOutResponse) -> dict[str, float]:
    """Milliseconds per part: the abort's way into the source engine and the step it waits for, that
    engine's copy and send of the last blocks, its event's way to the llumlet, Commit's two messages,
    and the destination's Commit received -> first token (its own split: `destination_admitted_ms`,
    `destination_kv_load_ms`)."""
    return {
        "source_stop": answer.final_stage_ms - answer.final_stage_kv_ms - answer.final_stage_event_ms,
        "source_kv": answer.final_stage_kv_ms,
        "source_event": answer.final_stage_event_ms,
        "commit_transit": answer.commit_ms - answer.destination_first_token_ms,
        "destination": answer.destination_first_token_ms,
    }
