"""A simulated vLLM (v0) instance: paged KV blocks, a FIFO queue and continuous batching.

Scheduling follows vLLM v0's default scheduler, which the paper used:
- An iteration either prefills or decodes (prefill first, no chunking). Prefills are admitted from
  the head of the queue while the batch stays within `max_num_seqs` and `max_num_batched_tokens`
  and the free blocks stay above a watermark (1% of the blocks). A prompt longer than the token
  budget is still admitted alone (the simulated engine's maximum length covers the traces).
- A decode step needs a new block for every request whose next token starts one. When none is
  free, the latest-arrived running request is preempted by recompute: its blocks are freed, it
  goes back to the head of the queue and later prefills its prompt plus generated tokens again.
- With `queue_passing` (a what-if, not vLLM) a queued request that fits is admitted even when one
  ahead of it does not.
- High-priority requests are queued ahead of normal ones and preempted only when no normal
  request is left to preempt.
- With `chunked_prefill_tokens`, an iteration decodes every running request and fills the rest of
  that token budget with prefill chunks (vLLM v0's chunked prefill; blocks for the whole prompt are
  allocated when the request is admitted).
- With `prefix_caching`, full blocks are kept by content hash (`llumnix.sim.block_cache`): a request
  whose leading blocks are cached skips their prefill, blocks held by other requests are shared,
  and freed blocks stay cached until an allocation evicts them. Requests without block hashes
  (the paper's traces: no two share content) neither hit nor leave anything cached.

The cluster drives the instance: `plan(now)` picks the next iteration's work and returns its
duration (from the latency profile); `complete(now)` applies it and returns the finished requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.prefix_cache import cacheable_blocks
from llumnix.sim.block_cache import BlockCache
from llumnix.sim.request import FINISHED, PREFILLING, RESUMING, RUNNING, SUSPENDED, WAITING, SimRequest

IterationTime = Callable[[int, int, int, int], float]
"""(prefill tokens, decoding sequences, their context tokens, prefill attention's squared tokens)
-> seconds (`LatencyProfile.iteration_time`)."""


DEFAULT_WATERMARK = 0.01
"""vLLM v0's admission watermark, the paper's engine (vLLM 0.32 keeps none unless told)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    total_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    watermark: float = DEFAULT_WATERMARK
    """Fraction of the blocks kept free when admitting a prefill."""
    chunked_prefill_tokens: int = 0
    """Token budget of a chunked-prefill iteration (vLLM v0's default with chunking on: 512);
    0: prefill-first, no chunking."""
    prefix_caching: bool = False
    queue_passing: bool = False
    """A what-if engine: requests behind a queued request that does not fit are admitted when they
    fit (vLLM admits from the head only, so a large head blocks its whole queue)."""

    def __post_init__(self) -> None:
        if not 0 <= self.watermark < 1:
            raise ValueError(
                f"the watermark is a share of the blocks, at least 0 and below 1, not {self.watermark}"
            )

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.total_blocks)

    @property
    def admission_blocks(self) -> int:
        """The blocks a request can be admitted into: all but the watermark the engine keeps free
        when admitting (decodes may still grow into it)."""
        return self.total_blocks - self.watermark_blocks


class SimInstance:
    """One engine. Block accounting: `free_blocks` are neither allocated to a request nor reserved
    for a migration coming in; `reserved_blocks` are held for incoming migrations."""

    def __init__(self, instance_id: str, config: EngineConfig, iteration_time: IterationTime) -> None:
        self.instance_id = instance_id
        self.config = config
        self.iteration_time = iteration_time
        self.block_size = config.block_size
        self.total_blocks = config.total_blocks
        self.free_blocks = config.total_blocks
        self.reserved_blocks = 0
        self.waiting: list[SimRequest] = []
        self._waiting_high = 0
        """How many requests at the head of `waiting` are high priority."""
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.suspended: list[SimRequest] = []
        self.resumed: list[SimRequest] = []
        """Migrated in; they join the batch at the next iteration."""
        self.context_tokens = 0
        """Sum of sequence lengths of `running` (the decode batch's context)."""
        self.busy = False
        self.draining = False
        self.preemptions_since_read = 0
        self.migrating_in = 0
        self.migrating_out = 0
        self._decoding: list[SimRequest] = []
        self._prefill_chunks: list[tuple[SimRequest, int]] = []
        self._snapshot: InstanceLoad | None = None
        self.cache = BlockCache() if config.prefix_caching else None
        # Totals for the run's metrics.
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        """Prompt tokens whose prefill a cache hit saved."""

    # ----- queue -----

    def enqueue(self, request: SimRequest) -> None:
        """A new request joins the queue (behind earlier requests of its class)."""
        request.state = WAITING
        request.instance_id = self.instance_id
        if request.high_priority:
            self.waiting.insert(self._waiting_high, request)
            self._waiting_high += 1
        else:
            self.waiting.append(request)
        self._snapshot = None

    def _requeue_at_head(self, request: SimRequest) -> None:
        request.state = WAITING
        if request.high_priority:
            self.waiting.insert(0, request)
            self._waiting_high += 1
        else:
            self.waiting.insert(self._waiting_high, request)

    def _pop_waiting(self, index: int) -> SimRequest:
        request = self.waiting.pop(index)
        if request.high_priority:
            self._waiting_high -= 1
        return request

    @property
    def admission_blocks(self) -> int:
        """The instance reports the engine's admission blocks as its memory, so that dispatch and
        migration see the room the engine gives a new request."""
        return self.config.admission_blocks

    @property
    def admission_free_blocks(self) -> int:
        """Free blocks above the admission watermark."""
        return max(0, self.free_blocks - self.config.watermark_blocks)

    @property
    def num_requests(self) -> int:
        return (
            len(self.waiting)
            + len(self.prefilling)
            + len(self.running)
            + len(self.suspended)
            + len(self.resumed)
        )

    # ----- one iteration -----

    def plan(self, now: float) -> float | None:
        """Choose the next iteration's work, allocate its blocks; its duration, or None if idle."""
        if self.resumed:
            for request in self.resumed:
                request.state = RUNNING
                self.running.append(request)
                self.context_tokens += request.tokens
            self.resumed.clear()
        self._snapshot = None
        chunked = self.config.chunked_prefill_tokens > 0
        duration = self._plan_chunked(now) if chunked else self._plan_prefill_first(now)
        self.busy = duration is not None
        return duration

    def scheduled_tokens(self) -> dict[str, int]:
        """Tokens the planned iteration computes, by request id (vLLM's `num_scheduled_tokens`)."""
        scheduled = {request.request_id: 1 for request in self._decoding}
        for request, tokens in self._prefill_chunks:
            scheduled[request.request_id] = tokens
        return scheduled

    def _plan_prefill_first(self, now: float) -> float | None:
        chunks = self._admit(self.config.max_num_batched_tokens, whole_prompts=True)
        if chunks:
            self._decoding = []
            self._prefill_chunks = chunks
            prefill_tokens, square_tokens = _prefill_cost(chunks)
            return self.iteration_time(prefill_tokens, 0, 0, square_tokens)
        if not self.running:
            return None
        self._grow_for_decode(now)
        self._decoding = list(self.running)
        self._prefill_chunks = []
        if not self._decoding:
            return None
        return self.iteration_time(0, len(self._decoding), self.context_tokens, 0)

    def _plan_chunked(self, now: float) -> float | None:
        if self.running:
            self._grow_for_decode(now)
        self._decoding = list(self.running)
        budget = self.config.chunked_prefill_tokens - len(self._decoding)
        chunks: list[tuple[SimRequest, int]] = []
        for request in self.prefilling:
            if budget <= 0:
                break
            tokens = min(budget, request.prefill_target - request.prefilled)
            chunks.append((request, tokens))
            budget -= tokens
        if budget > 0:
            chunks.extend(self._admit(budget, whole_prompts=False))
        self._prefill_chunks = chunks
        if not chunks and not self._decoding:
            return None
        prefill_tokens, square_tokens = _prefill_cost(chunks)
        return self.iteration_time(prefill_tokens, len(self._decoding), self.context_tokens, square_tokens)

    def _admit(self, token_budget: int, whole_prompts: bool) -> list[tuple[SimRequest, int]]:
        """Move requests from the queue head into prefill while blocks, sequences and tokens allow
        (with `queue_passing`, past queued requests whose blocks are not free)."""
        chunks: list[tuple[SimRequest, int]] = []
        config = self.config
        seqs = len(self.running) + len(self.prefilling) + len(self.suspended)
        watermark = config.watermark_blocks
        index = 0
        while index < len(self.waiting) and seqs < config.max_num_seqs and token_budget > 0:
            request = self.waiting[index]
            target = request.tokens
            if whole_prompts and target > token_budget and chunks:
                break
            need = -(-target // self.block_size)
            cache = self.cache
            hashes = request.block_hashes[: target // self.block_size] if cache is not None else ()
            new = need - cache.shared(hashes) if cache is not None else need
            if self.free_blocks - new < watermark:
                if config.queue_passing:
                    index += 1
                    continue
                break
            self._pop_waiting(index)
            hit = 0
            if cache is not None and hashes:
                hit = cache.hit(hashes[: cacheable_blocks(target, self.block_size)]) * self.block_size
                cache.acquire(hashes)
                request.held_hashes = hashes
            self._take_free(new)
            request.blocks = need
            request.state = PREFILLING
            request.prefill_target = target
            # Staged KV counts as computed once; the last token is always recomputed.
            request.prefilled = max(min(request.cached_tokens, target - 1), hit)
            self.prefix_hit_tokens += max(0, hit - request.cached_tokens)
            request.cached_tokens = 0
            self.prefilling.append(request)
            left = target - request.prefilled
            tokens = left if whole_prompts else min(left, token_budget)
            chunks.append((request, tokens))
            token_budget -= tokens
            seqs += 1
        return chunks

    def _grow_for_decode(self, now: float) -> None:
        """Give every running request the block its next token needs, preempting when none is free."""
        block_size = self.block_size
        for request in list(self.running):
            if (
                request.state != RUNNING
                or request.prompt_tokens + request.generated <= request.blocks * block_size
            ):
                continue
            while self.free_blocks <= 0 and request.state == RUNNING:
                self._preempt(self._preemption_victim(), now)
            if request.state == RUNNING:
                request.blocks += 1
                self._take_free(1)

    def _take_free(self, blocks: int) -> None:
        """Allocate free blocks; cached content in them is evicted, the least recently freed first."""
        self.free_blocks -= blocks
        if self.cache is not None:
            self.cache.fit(self.free_blocks)

    def _free_request_blocks(self, request: SimRequest) -> None:
        """Return a request's blocks: the ones it shares stay with their other holders, full blocks of
        its computed tokens stay cached among the free blocks."""
        freed = request.blocks
        if self.cache is not None and (request.held_hashes or request.block_hashes):
            held = request.held_hashes
            computed = min(request.blocks, (request.tokens - 1) // self.block_size)
            content = request.block_hashes[len(held) : computed]
            freed += self.cache.release(held, content) - len(held)
            request.held_hashes = ()
        self.free_blocks += freed
        request.blocks = 0

    def _preemption_victim(self) -> SimRequest:
        """The latest-arrived request, normal priority before high priority."""
        candidates = self.running + self.prefilling
        return max(candidates, key=lambda r: (not r.high_priority, r.arrival_time))

    def _preempt(self, request: SimRequest, now: float) -> None:
        if request.state == RUNNING:
            self.running.remove(request)
            self.context_tokens -= request.tokens
        else:
            self.prefilling.remove(request)
        self._free_request_blocks(request)
        request.prefilled = 0
        request.preemptions += 1
        if request.preempted_at < 0:
            request.preempted_at = now
        self._requeue_at_head(request)
        self.preemptions += 1
        self.preemptions_since_read += 1

    def complete(self, now: float) -> list[SimRequest]:
        """Apply the planned iteration at its end time; return the requests that finished."""
        self.busy = False
        self._snapshot = None
        finished: list[SimRequest] = []
        decoding = self._decoding
        if decoding:
            instance_id = self.instance_id
            stepped = 0
            for request in decoding:
                if request.state != RUNNING or request.instance_id != instance_id:
                    continue  # suspended (or even migrated away) for a migration's final stage meanwhile
                stepped += 1
                request.generated += 1
                if request.generated >= request.output_tokens:
                    finished.append(request)
            self.context_tokens += stepped
            self._decoding = []
        for request, tokens in self._prefill_chunks:
            if request.state != PREFILLING:
                continue
            request.prefilled += tokens
            if request.prefilled < request.prefill_target:
                continue
            self.prefilling.remove(request)
            request.generated += 1
            if request.first_token_time < 0:
                request.first_token_time = now
            if request.preempted_at >= 0:
                request.preemption_loss += now - request.preempted_at
                request.preempted_at = -1.0
            request.state = RUNNING
            self.running.append(request)
            self.context_tokens += request.tokens
            if request.generated >= request.output_tokens:
                finished.append(request)
        self._prefill_chunks = []
        for request in finished:
            self._finish(request, now)
        return finished

    def _finish(self, request: SimRequest, now: float) -> None:
        self.running.remove(request)
        self.context_tokens -= request.tokens
        self._free_request_blocks(request)
        request.state = FINISHED
        request.finish_time = now

    def abort(self, request: SimRequest, now: float) -> None:
        """Drop a request wherever it is and free its blocks (the sim engine: a client went away, or a
        stop condition the instance does not model ended it). A planned iteration skips it."""
        if request.state == WAITING:
            self.waiting.remove(request)
            if request.high_priority:
                self._waiting_high -= 1
        elif request.state == PREFILLING:
            self.prefilling.remove(request)
        elif request.state == RUNNING:
            self.running.remove(request)
            self.context_tokens -= request.tokens
        elif request.state == SUSPENDED:
            self.suspended.remove(request)
        elif request.state == RESUMING:
            self.resumed.remove(request)
        else:
            return
        self._free_request_blocks(request)
        request.state = FINISHED
        request.finish_time = now
        self._snapshot = None

    # ----- migration hooks (the cluster's migration state machine calls these) -----

    def reserve(self, blocks: int) -> bool:
        """Reserve blocks for an incoming migration; False when they are not free."""
        if blocks > self.free_blocks:
            return False
        self._take_free(blocks)
        self.reserved_blocks += blocks
        self._snapshot = None
        return True

    def unreserve(self, blocks: int) -> None:
        self.free_blocks += blocks
        self.reserved_blocks -= blocks
        self._snapshot = None

    def suspend(self, request: SimRequest) -> None:
        """Stop a running request for the final stage of its migration; its blocks stay held."""
        self.running.remove(request)
        self.context_tokens -= request.tokens
        request.state = SUSPENDED
        self.suspended.append(request)
        self._snapshot = None

    def unsuspend(self, request: SimRequest) -> None:
        """An aborted final stage: the request continues here."""
        self.suspended.remove(request)
        request.state = RESUMING
        self.resumed.append(request)
        self._snapshot = None

    def release_migrated(self, request: SimRequest, blocks: int, held_hashes: Sequence[int]) -> None:
        """The final stage is done: free the `blocks` the request held here (vLLM's delayed free);
        `held_hashes`, the cached blocks among them, stay cached here as free blocks."""
        self.suspended.remove(request)
        if self.cache is not None and held_hashes:
            blocks += self.cache.release(held_hashes) - len(held_hashes)
        self.free_blocks += blocks
        self._snapshot = None

    def adopt(self, request: SimRequest, reserved: int) -> bool:
        """Take over a migrated request from `reserved` blocks held for it, topping up from the free
        blocks if it grew; False (and nothing changes) when it no longer fits. Its full blocks become
        cached here (blocks other requests hold here are shared, not copied)."""
        need = -(-request.tokens // self.block_size)
        cache = self.cache
        hashes = request.block_hashes[: (request.tokens - 1) // self.block_size] if cache is not None else ()
        new = need - cache.shared(hashes) if cache is not None else need
        if new - reserved > self.free_blocks:
            return False
        if cache is not None:
            for block in hashes:
                cache.drop_free(block)  # the copy that arrived replaces an evictable one
            cache.acquire(hashes)
        request.held_hashes = hashes
        self.reserved_blocks -= reserved
        self._take_free(new - reserved)
        request.blocks = need
        request.instance_id = self.instance_id
        request.state = RESUMING
        self.resumed.append(request)
        self._snapshot = None
        return True

    def mark_migrating(self, request: SimRequest, migrating: bool) -> None:
        request.migrating = migrating
        self._snapshot = None

    def set_draining(self, draining: bool) -> None:
        self.draining = draining
        self._snapshot = None

    def read_preemptions(self) -> None:
        """The control loop has seen the preemptions reported so far."""
        if self.preemptions_since_read:
            self.preemptions_since_read = 0
            self._snapshot = None

    # ----- load reporting -----

    def snapshot(self) -> InstanceLoad:
        """The engine state in the shared load model's terms (cached until the state changes); its
        memory is the blocks above the admission watermark (`admission_blocks`)."""
        if self._snapshot is None:
            holding = [*self.prefilling, *self.running, *self.suspended, *self.resumed]
            running = tuple(
                RequestLoad(
                    r.request_id,
                    r.prompt_tokens,
                    r.generated,
                    r.blocks,
                    r.high_priority,
                    r.arrival_time,
                    r.migrating,
                )
                for r in holding
            )
            waiting = tuple(
                RequestLoad(r.request_id, r.prompt_tokens, r.generated, 0, r.high_priority, r.arrival_time)
                for r in self.waiting
            )
            self._snapshot = InstanceLoad(
                instance_id=self.instance_id,
                total_blocks=self.admission_blocks,
                free_blocks=self.admission_free_blocks + self.reserved_blocks,
                block_size=self.block_size,
                running=running,
                waiting=waiting,
                draining=self.draining,
                preemptions=self.preemptions_since_read,
                migrating_out=self.migrating_out,
                migrating_in=self.migrating_in,
                reserved_blocks=self.reserved_blocks,
            )
        return self._snapshot

    def head_of_line_blocked_demand(self) -> int:
        """Blocks the queue's head needs when memory is what keeps it waiting, else 0."""
        if not self.waiting:
            return 0
        need = -(-self.waiting[0].tokens // self.block_size)
        if self.free_blocks - need >= self.config.watermark_blocks:
            return 0
        return need

    def check_blocks(self) -> None:
        """Block accounting invariant (tests and debugging)."""
        held = sum(r.blocks for r in (*self.prefilling, *self.running, *self.suspended, *self.resumed))
        if self.cache is not None:
            held -= self.cache.shared_refs
            if self.cache.free_cached > self.free_blocks:
                raise AssertionError(f"{self.instance_id}: {self.cache.free_cached} free cached blocks"
                                     f" > {self.free_blocks} free blocks")
        if self.free_blocks < 0 or held + self.free_blocks + self.reserved_blocks != self.total_blocks:
            raise AssertionError(
                f"{self.instance_id}: free {self.free_blocks} + reserved {self.reserved_blocks} + held {held}"
                f" != total {self.total_blocks}"
            )


def _prefill_cost(chunks: list[tuple[SimRequest, int]]) -> tuple[int, int]:
    """Prefill tokens of an iteration and the squared-token measure of their causal attention: a chunk
    of c tokens after o already computed ones attends over (o + c)^2 - o^2 pairs."""
    tokens = 0
    square = 0
    for request, chunk in chunks:
        tokens += chunk
        square += chunk * (2 * request.prefilled + chunk)
    return tokens, square
