"""Multi-stage live migration of one request's KV cache between two simulated instances.

The paper's protocol (§4.2): the destination reserves blocks at the start; stage i copies the
blocks filled since the previous stage while the request keeps decoding on the source (full blocks
once, the partial tail block again each stage); when the remaining delta is at most one block, or
the stage bound is hit, the final stage stops the request on the source and copies the rest (that
copy is the downtime); the request then resumes on the destination with its KV cache, without
recompute. If the destination can no longer hold the request the migration aborts and the request
continues on its source; a request that finishes or is preempted meanwhile aborts it cleanly.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from llumnix.load import blocks_for_tokens
from llumnix.sim.instance import SimInstance
from llumnix.sim.request import RUNNING, SimRequest

TransferTime = Callable[[int], float]
"""tokens -> seconds to copy their KV cache to a peer."""


class Outcome(Enum):
    IN_PROGRESS = "in progress"
    COMPLETED = "completed"
    ABORTED = "aborted"


class Migration:
    """One migration's state. `start` and `on_stage_end` return when the current stage ends (an
    absolute virtual time), or None when the migration is over (see `outcome`)."""

    def __init__(
        self,
        request: SimRequest,
        source: SimInstance,
        destination: SimInstance,
        transfer_time: TransferTime,
        max_stages: int,
    ) -> None:
        self.request = request
        self.source = source
        self.destination = destination
        self.transfer_time = transfer_time
        self.max_stages = max_stages
        self.reserved = 0
        self.copied_full_blocks = 0
        self.stages = 0
        self.final = False
        self.final_started = 0.0
        self.downtime = 0.0
        self.outcome = Outcome.IN_PROGRESS

    def start(self, now: float) -> float | None:
        request, destination = self.request, self.destination
        if request.state != RUNNING or not destination.reserve(request.blocks + 1):
            self.outcome = Outcome.ABORTED
            return None
        self.reserved = request.blocks + 1
        self.source.migrating_out += 1
        destination.migrating_in += 1
        self.source.mark_migrating(request, True)
        return self._copy_stage(now)

    def _copy_stage(self, now: float) -> float:
        """Copy everything written since the previous stage, the partial tail block included."""
        block_size = self.source.block_size
        tokens = self.request.tokens
        delta = tokens - self.copied_full_blocks * block_size
        self.copied_full_blocks = tokens // block_size
        self.stages += 1
        return now + self.transfer_time(delta)

    def on_stage_end(self, now: float) -> float | None:
        if self.final:
            return self._finish_final_stage(now)
        request = self.request
        if request.state != RUNNING or request.instance_id != self.source.instance_id:
            return self._abort()  # finished or preempted on the source meanwhile
        if self.destination.draining or not self._grow_reservation():
            return self._abort()
        block_size = self.source.block_size
        remaining = request.tokens - self.copied_full_blocks * block_size
        if remaining <= block_size or self.stages >= self.max_stages:
            self.final = True
            self.final_started = now
            self.source.suspend(request)
            return self._copy_stage(now)
        return self._copy_stage(now)

    def _grow_reservation(self) -> bool:
        """Keep the destination's reservation at the request's size plus a block of growth."""
        need = blocks_for_tokens(self.request.tokens, self.source.block_size) + 1
        if need <= self.reserved:
            return True
        if not self.destination.reserve(need - self.reserved):
            return False
        self.reserved = need
        return True

    def _finish_final_stage(self, now: float) -> None:
        request, source, destination = self.request, self.source, self.destination
        self.downtime = now - self.final_started
        source_blocks, source_hashes = request.blocks, request.held_hashes
        if destination.draining or not destination.adopt(request, self.reserved):
            source.unsuspend(request)
            return self._abort()
        self.reserved = 0
        source.release_migrated(request, source_blocks, source_hashes)
        self._end(Outcome.COMPLETED)
        return None

    def _abort(self) -> None:
        self.destination.unreserve(self.reserved)
        self.reserved = 0
        self._end(Outcome.ABORTED)
        return None

    def _end(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.source.migrating_out -= 1
        self.destination.migrating_in -= 1
        self.source.mark_migrating(self.request, False)
