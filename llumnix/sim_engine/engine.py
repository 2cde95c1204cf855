"""The sim engine's core: a `SimInstance` (the simulator's vLLM model: paged KV blocks, continuous
batching, preemption by recompute) driven in real time, with tokens for every request it steps.

Each step: `plan` picks the iteration and returns its profile duration; the engine sleeps that long
(divided by the time scale); `complete` applies it; every request that got a token gets it (stop
checks, text), finished ones are released; then one `EngineSnapshot` is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llumnix.engine.engine_snapshot import build_snapshot
from llumnix.engine.prefix_cache_report import PrefixCacheReporter
from llumnix.prefix_cache import block_hashes, extend_block_hashes, root_hash
from llumnix.sim.instance import SimInstance
from llumnix.sim.request import FINISHED, SimRequest
from llumnix.sim_engine.requests import GenerationRequest
from llumnix.sim_engine.snapshot import capture_state
from llumnix.sim_engine.tokens import CONTEXT_TOKENS, EOS_TOKEN_ID, TokenGenerator, token_text
from llumnix.v1.engine_pb2 import EngineSnapshot

if TYPE_CHECKING:
    from llumnix.sim_engine.migration import SimMigrationAgent

logger = logging.getLogger("llumnix.sim_engine")

IDLE_REFRESH_S = 0.2
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_ABORT = "abort"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one step produced for one request (the engine's `RequestOutput` delta)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """One request in the engine: its simulated scheduling state, its tokens and its output queue."""

    def __init__(
        self, engine_request_id: str, params: GenerationRequest, sim: SimRequest, arrival_time: float
    ) -> None:
        self.engine_request_id = engine_request_id
        kv_params = params.kv_transfer_params or {}
        # Tracked by the llumlet's id, as the KV connector does: vLLM rewrites request ids.
        self.tracking_id = str(kv_params.get("llumlet_id") or engine_request_id)
        self.marked_high_priority = bool(kv_params.get("high_priority"))
        self.params = params
        self.sim = sim
        self.arrival_time = arrival_time
        self.output_ids: list[int] = []
        self._text = ""
        self._sent_chars = 0
        self._holdback = (
            0
            if params.include_stop_str_in_output or not params.stop
            else max(len(s) for s in params.stop) - 1
        )
        self.finish_reason: str | None = None
        self.outputs: asyncio.Queue[TokenDelta] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tail(self, n: int) -> list[int]:
        """The sequence's last `n` token ids (prompt, then generated)."""
        if len(self.output_ids) >= n:
            return self.output_ids[-n:]
        return [*self.params.prompt_token_ids[-n:], *self.output_ids][-n:]

    def add_token(self, token_id: int) -> None:
        """Appends a generated token, applies vLLM's stop checks and queues the delta."""
        params = self.params
        self.output_ids.append(token_id)
        self._text += token_text(token_id)
        count = len(self.output_ids)
        stop_reason: int | str | None = None
        if count >= params.min_tokens and token_id == EOS_TOKEN_ID:
            self.finish_reason = FINISH_STOP
        elif count >= params.min_tokens and token_id in params.stop_token_ids:
            self.finish_reason, stop_reason = FINISH_STOP, token_id
        elif count >= params.min_tokens and (
            hit := next((s for s in params.stop if self._text.endswith(s)), None)
        ):
            self.finish_reason, stop_reason = FINISH_STOP, hit
            if not params.include_stop_str_in_output:
                self._text = self._text[: -len(hit)]
        elif count >= params.max_tokens:
            self.finish_reason = FINISH_LENGTH
        # Text that could be the start of a stop string is held back until it is known not to be.
        end = len(self._text) if self.finished else max(self._sent_chars, len(self._text) - self._holdback)
        delta = self._text[self._sent_chars : end]
        self._sent_chars = end
        self.outputs.put_nowait(TokenDelta((token_id,), delta, self.finish_reason, stop_reason))

    def abort(self) -> None:
        self.finish_reason = FINISH_ABORT
        self.outputs.put_nowait(TokenDelta((), "", FINISH_ABORT))


SnapshotSink = Callable[[EngineSnapshot], None]


class SimEngine:
    def __init__(
        self,
        instance: SimInstance,
        tokens: TokenGenerator,
        time_scale: float = 1.0,
        engine_id: str = "sim-engine",
        snapshot_sink: SnapshotSink | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time scale must be positive, got {time_scale}")
        self.instance = instance
        self.tokens = tokens
        self.time_scale = time_scale
        self.engine_id = engine_id
        self.priority_scheduling = priority_scheduling
        self._snapshot_sink = snapshot_sink
        self.migration: SimMigrationAgent | None = None
        """Live migration (set by the server when the engine has a migration channel)."""
        self._generations: dict[str, Generation] = {}
        """By the SimRequest's id (the engine request id)."""
        self._work = asyncio.Event()
        self.step = 0
        # Totals for /metrics (vLLM's counters).
        self.finished_by_reason: Counter[str] = Counter()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries_total = 0
        """Prompt tokens looked up in the prefix cache (vLLM's vllm:prefix_cache_queries)."""
        self._prefix_report = PrefixCacheReporter() if instance.cache is not None else None

    @property
    def generations(self) -> list[Generation]:
        return list(self._generations.values())

    def add(self, engine_request_id: str, params: GenerationRequest) -> Generation:
        now = time.time()
        caching = self._prefix_report is not None
        sim = SimRequest(
            engine_request_id,
            now,
            len(params.prompt_token_ids),
            params.max_tokens,
            high_priority=self.priority_scheduling and params.priority < 0,
            block_hashes=block_hashes(params.prompt_token_ids, self.instance.block_size,
                                      root_hash(params.cache_salt)) if caching else None,
        )
        if caching:
            self.prefix_cache_queries_total += len(params.prompt_token_ids)
        generation = Generation(engine_request_id, params, sim, now)
        self._generations[engine_request_id] = generation
        if self.migration is not None:
            self.migration.on_add(generation)
        self.instance.enqueue(sim)
        self._work.set()
        return generation

    def abort(self, generation: Generation) -> None:
        """The client went away: free the request's blocks (a no-op once it finished)."""
        if generation.finished:
            return
        self.instance.abort(generation.sim, time.time())
        generation.abort()
        self._release(generation)

    def _release(self, generation: Generation) -> None:
        self._generations.pop(generation.engine_request_id, None)
        self.finished_by_reason[generation.finish_reason or FINISH_ABORT] += 1
        if self.migration is not None:
            self.migration.on_release(generation)
        self._work.set()

    async def run(self) -> None:
        """Steps the engine until cancelled. A snapshot follows every planned iteration; an idle engine
        refreshes it every `IDLE_REFRESH_S` (as the connector's snapshot pump does)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            duration = self.instance.plan(time.time()) if self.instance.num_requests else None
            self.publish()
            if duration is None:
                self._work.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), IDLE_REFRESH_S)
                continue
            scheduled = self.instance.scheduled_tokens()
            stepping = [self._generations[request_id] for request_id in scheduled]
            generated_before = [g.sim.generated for g in stepping]
            await asyncio.sleep(max(0.0, started + duration / self.time_scale - loop.time()))
            now = time.time()
            self.instance.complete(now)
            for generation, before in zip(stepping, generated_before, strict=True):
                if generation.sim.generated > before and not generation.finished:
                    self._emit(generation, now)
            if self.migration is not None:
                self.migration.after_step()

    def _emit(self, generation: Generation, now: float) -> None:
        sim = generation.sim
        if not generation.output_ids:
            self.prompt_tokens_total += sim.prompt_tokens
        eos_allowed = (
            not generation.params.ignore_eos and len(generation.output_ids) >= generation.params.min_tokens
        )
        generation.add_token(self.tokens.next_token(generation.tail(CONTEXT_TOKENS), eos_allowed))
        self.generation_tokens_total += 1
        block_size = self.instance.block_size
        tokens = sim.prompt_tokens + len(generation.output_ids)
        if self._prefix_report is not None and tokens % block_size == 0:
            # A block of generated tokens is full: it is cached when the request frees it, as vLLM's.
            sequence = [*generation.params.prompt_token_ids, *generation.output_ids]
            root = root_hash(generation.params.cache_salt)
            extend_block_hashes(sim.block_hashes, sequence, block_size, root)
        if generation.finished:
            if sim.state != FINISHED:
                self.instance.abort(sim, now)  # a stop condition the instance does not model
            self._release(generation)

    def publish(self) -> None:
        """Publishes the engine state (once per step, as the KV connector does)."""
        self.step += 1
        if self._snapshot_sink is not None:
            now = time.time()
            state = capture_state(self.instance, self._generations, now)
            snapshot = build_snapshot(self.engine_id, self.step, self.instance.block_size, state)
            report, cache = self._prefix_report, self.instance.cache
            if report is not None and cache is not None:
                stored, removed = cache.take_changes()
                report.stored(stored)
                report.removed(removed)
                update = report.update(now)
                if update is not None:
                    snapshot.prefix_cache.CopyFrom(update)
            self._snapshot_sink(snapshot)
