"""Choose an instance for a request: the shared dispatch policy over the instances' latest loads plus
the router's in-flight accounting, and a bounded queue (priority, then arrival) that holds requests
while every instance is busy. A request whose prompt token ids are known is looked up in the
instances' prefix caches (the index their load streams keep), so the policy can prefer an instance
that has its prefix cached."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from dataclasses import dataclass, field

from llumnix.load import RequestLoad, engine_queues
from llumnix.policies.dispatch import NO_CACHE, CachedBlocks, DispatchPolicy, dispatch_held, placement
from llumnix.prefix_cache import block_hashes, cacheable_blocks
from llumnix.router.errors import RouterError
from llumnix.router.instances import Instance, InstanceSet
from llumnix.router.metrics import RouterMetrics
from llumnix.router.prompt_ids import PromptTokens


class Dispatcher:
    """Chooses over the policy's ranking of the instances. Every change of an instance's effective
    load updates the ranking as it happens, so a decision reads only the instances that can win."""

    def __init__(self, policy: DispatchPolicy, instances: InstanceSet, metrics: RouterMetrics | None = None,
                 prompt_ids: PromptTokens | None = None) -> None:
        self.policy = policy
        self.prompt_ids = prompt_ids or PromptTokens()
        """A request's prompt token ids (`RequestLoad.prompt_token_ids`), where the router knows them."""
        self.instances = instances
        self.metrics = metrics
        self._ranking = policy.ranking()
        self._by_id: dict[str, Instance] = {}
        self._ranked_as: dict[Instance, str] = {}
        """The instance id each ranked instance is ranked under (a restarted llumlet may change it)."""
        self._idle: dict[Instance, None] = {}
        """Ranked instances with nothing to finish, not draining."""
        self._block_size = 0
        """Of the instances' KV blocks (one model, one block size), for hashing prompts."""
        self._hashed: tuple[str, int, list[int]] = ("", 0, [])
        """(request id, block size, prompt block hashes) of the request dispatched last: a held
        request is dispatched again on every wake-up."""
        for instance in instances.all():
            self._rerank(instance)
        instances.on_load_change(self._rerank)

    def dispatch(self, request: RequestLoad, passed_s: float = 0.0) -> Instance | None:
        """The chosen instance, with the request reserved on it; None to hold the request (no
        instance, or every instance busy while some of them has work that will finish; `placement`).
        `passed_s`: how long since a held request was first passed by one dispatched ahead of it."""
        started = time.perf_counter()
        now = time.monotonic()
        by_id = self._by_id
        decision = self._ranking.choose(request, lambda instance_id: by_id[instance_id].dispatchable(now),
                                        self._cached_blocks(request))
        chosen_id = placement(decision,
                              lambda instance_id: engine_queues(by_id[instance_id].effective_load(), request),
                              lambda instance_id: by_id[instance_id].is_idle(),
                              (i.instance_id for i in self._idle if i.dispatchable(now)), passed_s)
        chosen = None if chosen_id is None else by_id[chosen_id]
        if chosen is not None:
            chosen.reserve(request)
        if self.metrics is not None:
            self.metrics.dispatch_seconds.observe(time.perf_counter() - started)
        return chosen

    def _cached_blocks(self, request: RequestLoad) -> CachedBlocks:
        """The request's prompt blocks each instance has cached."""
        index = self.instances.prefix_index
        if not request.prompt_token_ids or not len(index) or self._block_size < 1:
            return NO_CACHE
        request_id, block_size, hashes = self._hashed
        if request_id != request.request_id or block_size != self._block_size:
            block_size, tokens = self._block_size, request.prompt_token_ids
            cacheable = cacheable_blocks(len(tokens), block_size) * block_size
            hashes = block_hashes(tokens[:cacheable], block_size, request.prefix_root)
            self._hashed = (request.request_id, block_size, hashes)
        return index.cached_blocks(hashes)

    def _rerank(self, instance: Instance) -> None:
        load = None if instance.removed or not instance.has_engine_load() else instance.effective_load()
        ranked_as = self._ranked_as.get(instance)
        if ranked_as is not None and (load is None or load.instance_id != ranked_as):
            del self._ranked_as[instance]
            if self._by_id.get(ranked_as) is instance:
                del self._by_id[ranked_as]
                self._ranking.discard(ranked_as)
        if load is None:
            self._idle.pop(instance, None)
            return
        self._ranked_as[instance] = load.instance_id
        self._by_id[load.instance_id] = instance
        self._block_size = load.block_size
        self._ranking.update(load)
        if instance.is_idle() and not load.draining:
            self._idle[instance] = None
        else:
            self._idle.pop(instance, None)


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    request: RequestLoad = field(compare=False)
    future: asyncio.Future[Instance] = field(compare=False)
    passed_at: float | None = field(default=None, compare=False)
    """When a request behind it was first dispatched ahead of it."""


class DispatchQueue:
    """Requests wait here while `Dispatcher.dispatch` holds them; `wake()` (after every load update,
    release and membership change) offers them in order, high priority first, then arrival
    (`dispatch_held`: one that does not fit yet lets smaller ones of its priority pass)."""

    def __init__(self, dispatcher: Dispatcher, capacity: int, timeout_s: float,
                 metrics: RouterMetrics | None = None) -> None:
        self.dispatcher = dispatcher
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._held: list[_Waiter] = []
        """In dispatch order."""
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(1 for w in self._held if not w.future.done())

    def held_tokens(self) -> list[int]:
        """The tokens each held request needs, in the order they will be offered."""
        return [w.request.total_tokens for w in self._held if not w.future.done()]

    def _update_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length.set(len(self))

    async def acquire(self, request: RequestLoad, high_priority: bool) -> Instance:
        """An instance with `request` reserved on it; RouterError 503 (with Retry-After) when the queue
        is full or the request waited `timeout_s`."""
        if not self._held:
            instance = self.dispatcher.dispatch(request)
            if instance is not None:
                return instance
        if len(self) >= self.capacity:
            raise RouterError(503, f"every instance is busy and {self.capacity} requests are already "
                              "waiting; retry later", "ServiceUnavailableError", retry_after_s=1.0)
        future: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
        bisect.insort(self._held, _Waiter(0 if high_priority else 1, next(self._seq), request, future))
        self._update_gauge()
        self.wake()
        try:
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release(request.request_id)
            future.cancel()
            raise
        finally:
            self._update_gauge()
        if not done:
            future.cancel()
            self._update_gauge()
            raise RouterError(503, f"no instance could take the request within {self.timeout_s:g} s; "
                              "retry later", "ServiceUnavailableError", retry_after_s=1.0)
        return future.result()

    def wake(self) -> None:
        if self._held:
            now = time.monotonic()

            def place(waiter: _Waiter) -> bool:
                passed_s = 0.0 if waiter.passed_at is None else now - waiter.passed_at
                instance = self.dispatcher.dispatch(waiter.request, passed_s)
                if instance is not None:
                    waiter.future.set_result(instance)
                return instance is not None

            def passed(waiter: _Waiter) -> None:
                if waiter.passed_at is None:
                    waiter.passed_at = now

            waiting = [w for w in self._held if not w.future.done()]
            self._held = dispatch_held(waiting, lambda w: w.request.total_tokens, lambda w: w.rank == 0,
                                       place, passed)
        self._update_gauge()

    def fail_all(self, error: RouterError) -> None:
        for waiter in self._held:
            if not waiter.future.done():
                waiter.future.set_exception(error)
        self._held.clear()
        self._update_gauge()
