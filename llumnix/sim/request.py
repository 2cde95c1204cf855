"""A request's state as the simulated engine and the metrics see it."""

from __future__ import annotations

from collections.abc import Sequence

# Request states. Ints, not an Enum: they are compared in the simulator's innermost loop.
WAITING = 0
PREFILLING = 1
RUNNING = 2
SUSPENDED = 3
"""Stopped on its source for the final stage of a migration (its blocks are still held there)."""
RESUMING = 4
"""Handed back to (or migrated into) an instance; it joins the batch at the next iteration."""
FINISHED = 5


class SimRequest:
    """One request: its trace attributes, its progress and its timestamps (virtual seconds)."""

    __slots__ = (
        "arrival_time",
        "best_cached_blocks",
        "block_hashes",
        "blocks",
        "cached_tokens",
        "dispatched_cached_blocks",
        "finish_time",
        "first_token_time",
        "generated",
        "held_hashes",
        "high_priority",
        "instance_id",
        "migrating",
        "output_tokens",
        "preempted_at",
        "preemption_loss",
        "preemptions",
        "prefill_target",
        "prefilled",
        "prompt_tokens",
        "request_id",
        "state",
        "trace_high_priority",
    )

    def __init__(
        self,
        request_id: str,
        arrival_time: float,
        prompt_tokens: int,
        output_tokens: int,
        trace_high_priority: bool = False,
        high_priority: bool = False,
        block_hashes: list[int] | None = None,
    ) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"request {request_id}: prompt and output must be at least one token")
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.trace_high_priority = trace_high_priority
        """The trace's class (reported separately even when the system ignores priorities)."""
        self.high_priority = high_priority
        """The class the system schedules by."""
        self.generated = 0
        self.blocks = 0
        self.prefilled = 0
        """Tokens of the current prefill computed so far (chunked prefill computes it in pieces)."""
        self.prefill_target = 0
        """Tokens the current prefill computes: the prompt, plus generated tokens after a preemption."""
        self.cached_tokens = 0
        """Tokens whose KV arrives with the request (a live migration's staged KV): its first prefill
        skips them."""
        self.block_hashes = block_hashes if block_hashes is not None else []
        """Content hashes of the full blocks of its tokens as far as they are known (prompt, and
        output where the trace fixes it or as it is generated; `llumnix.prefix_cache`); empty:
        content no other request shares."""
        self.best_cached_blocks = 0
        """At its (last) dispatch: the most blocks of its prompt any instance had cached."""
        self.dispatched_cached_blocks = 0
        """At its (last) dispatch: the blocks of its prompt the chosen instance had cached."""
        self.held_hashes: Sequence[int] = ()
        """The cached blocks it holds on its instance (a prefix of `block_hashes`)."""
        self.state = WAITING
        self.instance_id = ""
        self.migrating = False
        self.first_token_time = -1.0
        self.finish_time = -1.0
        self.preemptions = 0
        self.preempted_at = -1.0
        self.preemption_loss = 0.0

    @property
    def tokens(self) -> int:
        """Sequence length: prompt plus generated tokens."""
        return self.prompt_tokens + self.generated
