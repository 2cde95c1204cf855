"""The simulated instance's state in the KV connector's terms (`llumnix.engine.engine_snapshot`), so that the
sim engine publishes the very `EngineSnapshot` the connector builds inside vLLM, with requests named
by the llumlet's id."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from llumnix.engine.engine_snapshot import EngineState, RequestRow
from llumnix.sim.instance import SimInstance
from llumnix.sim.request import PREFILLING, RUNNING, WAITING, SimRequest

if TYPE_CHECKING:
    from llumnix.sim_engine.engine import Generation


def _computed_tokens(sim: SimRequest) -> int:
    """Tokens whose KV is in the cache before the planned iteration runs."""
    if sim.state == PREFILLING:
        return sim.prefilled
    if sim.state == RUNNING:
        return sim.tokens - 1  # the newest sampled token is computed by the next decode
    return 0


def capture_state(instance: SimInstance, generations: Mapping[str, Generation], now: float) -> EngineState:
    """The state once an iteration is planned, as the connector captures it when vLLM's scheduler has
    scheduled a step: computed tokens include the step's scheduled ones, whose blocks are allocated.
    Its memory is the blocks above the admission watermark (`SimInstance.admission_blocks`): what a
    new request can be admitted into.
    `generations` by engine request id (the SimRequests' ids)."""
    scheduled = instance.scheduled_tokens()

    def row(sim: SimRequest) -> RequestRow:
        generation = generations[sim.request_id]
        return RequestRow(
            request_id=generation.tracking_id,
            engine_request_id=sim.request_id,
            prompt_tokens=sim.prompt_tokens,
            output_tokens=sim.generated,
            computed_tokens=_computed_tokens(sim) + scheduled.get(sim.request_id, 0),
            blocks=sim.blocks,
            high_priority=sim.high_priority or generation.marked_high_priority,
            arrival_time=generation.arrival_time,
            queued=sim.state == WAITING,
            preempted=sim.state == WAITING and sim.preemptions > 0,
        )

    holding = [*instance.prefilling, *instance.running, *instance.suspended, *instance.resumed]
    return EngineState(
        timestamp=now,
        total_blocks=instance.admission_blocks,
        free_blocks=instance.admission_free_blocks,
        preemptions_total=instance.preemptions,
        requests=[row(sim) for sim in (*holding, *instance.waiting)],
    )
