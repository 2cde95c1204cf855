"""Dispatch policies: choose the instance for a new request.

A small framework in the style of llm-d's scheduler: each policy is a pure
`score(load, request) -> float` (higher is better) plus an optional filter, and one picker that takes
the best score with a random tie-break among the top k. Round-robin is the one stateful policy (a
cursor).

The picker works on a `Ranking` that is kept one load at a time. The router keeps one over all of its
instances and decides on every request; a choice scores only the instances that can win, taken in
the order of a request-independent upper bound of their score. `choose` over a list of loads (the
simulator) builds one per call, so both make the same choices.

Prefix-cache aware dispatch: a choice may name, per instance, how many blocks of the request's
prompt that instance has cached (`llumnix.prefix_cache.PrefixIndex`). A policy with a prefix score
scores those instances explicitly, before the bound-ordered walk over the others (whose bounds need
not cover a cache hit). llumnix's (`prefix_freeness`): the cached blocks are blocks the request does
not need there, and the headroom above the busy threshold is worth 1 + weight x (share of the prompt
cached) as much, for the prefill the hit saves.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    InstanceLoad,
    LoadModelConfig,
    RequestLoad,
    dispatch_freeness,
    dispatch_peers,
    memory_load,
)

T = TypeVar("T")

POLICY_NAMES = ("llumnix", "infaas++", "round-robin", "least-requests")

DEFAULT_BUSY_FREENESS = 0.0
"""Below this freeness an instance is busy: a new request would wait in its queue."""

QUEUED_HEADROOM = 3.0
"""On an instance with requests in its queue, llumnix dispatch counts headroom above the busy threshold
in full only up to this many blocks per request, and beyond it at `QUEUED_HEADROOM_SLOPE`
(`queue_freeness`). 3 is the freeness below which migration takes requests off an instance
(`MigrationConfig.freeness_threshold`)."""

QUEUED_HEADROOM_SLOPE = 1e-3
"""What a block per request of headroom beyond `QUEUED_HEADROOM` counts on an instance with a queue:
enough to keep such instances in order, little enough that any instance without a queue and more
than `QUEUED_HEADROOM` wins."""

DEFAULT_PREFIX_WEIGHT = 2.0
"""How much llumnix dispatch values the prefill a cache hit saves (`prefix_freeness`); 0: caches are
ignored."""

NO_CACHE: Mapping[str, float] = {}

NO_TOKENS = RequestLoad("", 0)
"""The smallest request: it needs no blocks, only a batch slot."""


@dataclass(frozen=True, slots=True)
class DispatchDecision:
    instance_id: str
    all_busy: bool = False
    """Every candidate was busy: the request will queue (the router may hold it instead)."""


def _any_instance(_instance_id: str) -> bool:
    return True


def dispatch_held(held: Sequence[T], tokens: Callable[[T], int], high_priority: Callable[[T], bool],
                  place: Callable[[T], bool], passed: Callable[[T], None]) -> list[T]:
    """Offers the held requests (high priority first, then in arrival order) to `place` (True:
    dispatched); returns those still held, in order. A request that cannot be placed does not block
    the smaller requests of its priority behind it (they may fit where it does not), only those at
    least as large (they cannot fit either, so they are not offered) and, if it is high priority,
    every normal one (room freed goes to high-priority requests first). `passed` is called with each
    held request that a request behind it was dispatched ahead of."""
    still_held: list[T] = []
    blocked = {True: math.inf, False: math.inf}
    """Per priority: the size from which requests are not offered."""
    for request in held:
        size, high = tokens(request), high_priority(request)
        if size < blocked[high] and place(request):
            for ahead in still_held:
                passed(ahead)
            continue
        still_held.append(request)
        blocked[high] = min(blocked[high], size)
        if high:
            blocked[False] = 0.0
    return still_held


MAX_HOLD_S = 30.0
"""How long a request may be held after a smaller one was dispatched ahead of it, before it goes to
the instance the policy chose and waits in that engine's queue, where it is admitted in order."""


def placement(decision: DispatchDecision | None, engine_queues: Callable[[str], bool],
              is_idle: Callable[[str], bool], idle: Iterable[str], passed_s: float = 0.0) -> str | None:
    """Where a request goes now; None to hold it in the router's queue until room is freed.

    The decision's instance, unless every instance is busy and that one's engine would queue the
    request (`engine_queues`; busy also counts the high-priority headroom, which only steers) and it
    has work to finish: then an instance with nothing to finish if there is one (nothing would ever
    wake a held request for it, and a request too large for every instance must go somewhere), else
    hold. Holding keeps a burst's overflow in one queue, served by whichever instance frees room first,
    instead of behind one instance's running requests. The queue lets smaller requests that fit pass
    a held one, so a large one could wait for ever: `MAX_HOLD_S` after it was first passed
    (`passed_s`), it goes to the chosen instance anyway. `idle` is read only when needed (instances
    with nothing to finish that may take requests, in preference order)."""
    if decision is None:
        return None
    chosen = decision.instance_id
    if not decision.all_busy or passed_s >= MAX_HOLD_S or not engine_queues(chosen) or is_idle(chosen):
        return chosen
    return next(iter(idle), None)


CachedBlocks = Mapping[str, float]
"""Instance id -> blocks of the request's prompt cached there (instances without any left out)."""


class Ranking(ABC):
    """The instances a policy chooses among. Draining instances are never chosen; None means there
    is no instance to choose."""

    @abstractmethod
    def update(self, load: InstanceLoad) -> None:
        """Add the instance of `load` or replace its previous load."""

    @abstractmethod
    def discard(self, instance_id: str) -> None: ...

    @abstractmethod
    def choose(
        self,
        request: RequestLoad | None = None,
        eligible: Callable[[str], bool] = _any_instance,
        cached: CachedBlocks = NO_CACHE,
    ) -> DispatchDecision | None:
        """`eligible` passes over instances the caller cannot send to (the router's unreachable ones);
        it is asked only about instances that could be chosen. `cached`: the request's prompt blocks
        cached per instance (policies without a prefix score ignore it)."""


class DispatchPolicy(ABC):
    """Choose an instance for a request."""

    name: str = ""

    @abstractmethod
    def ranking(self) -> Ranking:
        """An empty ranking that chooses by this policy (and shares its state: cursor, random
        generator)."""

    def choose(
        self,
        loads: Sequence[InstanceLoad],
        request: RequestLoad | None = None,
        cached: CachedBlocks = NO_CACHE,
    ) -> DispatchDecision | None:
        """One choice among `loads` (over a ranking built for it)."""
        ranking = self.ranking()
        for load in loads:
            ranking.update(load)
        return ranking.choose(request, cached=cached)


class ScoringPolicy(DispatchPolicy):
    """Highest score wins; ties (and the top k when k > 1) are broken at random.

    `bound(load)` is the highest score any request can get on that instance; None when the score
    does not depend on the request. Loads with equal `peers(load)` score, for every request, in the
    order of their bounds and at least as far apart (equal bounds, equal scores); None: when the
    score does not depend on the request all loads are peers, otherwise none. `is_busy` is a
    threshold: every busy score is below every free one.

    `prefix_score(load, request, cached_blocks)` scores an instance that has `cached_blocks` of the
    request's prompt cached (None: the cache does not change the score). Such instances are scored
    explicitly, so it may exceed `bound`, which bounds scores without a cache hit; it must keep
    `is_busy` as the score without the hit would (a hit does not make a busy instance free)."""

    def __init__(
        self,
        name: str,
        score: Callable[[InstanceLoad, RequestLoad | None], float],
        bound: Callable[[InstanceLoad], float] | None = None,
        peers: Callable[[InstanceLoad], Hashable] | None = None,
        is_busy: Callable[[float], bool] = lambda _score: False,
        top_k: int = 1,
        rng: random.Random | None = None,
        prefix_score: Callable[[InstanceLoad, RequestLoad | None, float], float] | None = None,
    ) -> None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.name = name
        self.score = score
        self.bound = bound
        if peers is None:
            peers = (lambda _load: None) if bound is None else (lambda load: load.instance_id)
        self.peers = peers
        self.is_busy = is_busy
        self.top_k = top_k
        self.rng = rng or random.Random(0)
        self.prefix_score = prefix_score

    def ranking(self) -> Ranking:
        return _ScoreRanking(self)

    def score_cached(self, load: InstanceLoad, request: RequestLoad | None, cached_blocks: float) -> float:
        """The score of an instance with `cached_blocks` of the request's prompt cached."""
        if cached_blocks <= 0 or self.prefix_score is None:
            return self.score(load, request)
        return self.prefix_score(load, request, cached_blocks)


class _Peers:
    """Instances that are peers, in order of their bound (highest first), then of their id."""

    __slots__ = ("ids", "keys", "serial")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        """Orders peers whose best bounds are equal (their keys need not be comparable)."""
        self.keys: list[float] = []
        """The negated bounds, ascending."""
        self.ids: list[str] = []

    def _at(self, key: float, instance_id: str) -> int:
        low = bisect.bisect_left(self.keys, key)
        return bisect.bisect_left(self.ids, instance_id, low, bisect.bisect_right(self.keys, key, low))

    def add(self, key: float, instance_id: str) -> None:
        at = self._at(key, instance_id)
        self.keys.insert(at, key)
        self.ids.insert(at, instance_id)

    def remove(self, key: float, instance_id: str) -> None:
        at = self._at(key, instance_id)
        del self.keys[at]
        del self.ids[at]


class _ScoreRanking(Ranking):
    """Instances grouped by their peers; the groups in order of their best bound."""

    def __init__(self, policy: ScoringPolicy) -> None:
        self._policy = policy
        self._loads: dict[str, tuple[float, Hashable, InstanceLoad]] = {}
        """Instance id -> (negated bound, peers, load)."""
        self._peers: dict[Hashable, _Peers] = {}
        self._heads: list[tuple[float, int, Hashable]] = []
        """(negated best bound, serial, peers) of every group, ascending."""
        self._serials = itertools.count()

    def update(self, load: InstanceLoad) -> None:
        if load.draining:
            self.discard(load.instance_id)
            return
        policy = self._policy
        key = -(policy.score(load, None) if policy.bound is None else policy.bound(load))
        peers = policy.peers(load)
        previous = self._loads.get(load.instance_id)
        self._loads[load.instance_id] = (key, peers, load)
        if previous is not None:
            if previous[0] == key and previous[1] == peers:
                return
            self._leave(previous[0], previous[1], load.instance_id)
        group = self._peers.get(peers)
        if group is None:
            group = self._peers[peers] = _Peers(next(self._serials))
            group.add(key, load.instance_id)
            bisect.insort(self._heads, (key, group.serial, peers))
            return
        head = group.keys[0]
        group.add(key, load.instance_id)
        if group.keys[0] != head:
            self._move_head(head, group, peers)

    def discard(self, instance_id: str) -> None:
        previous = self._loads.pop(instance_id, None)
        if previous is not None:
            self._leave(previous[0], previous[1], instance_id)

    def _leave(self, key: float, peers: Hashable, instance_id: str) -> None:
        group = self._peers[peers]
        head = group.keys[0]
        group.remove(key, instance_id)
        if not group.ids:
            del self._peers[peers]
            del self._heads[bisect.bisect_left(self._heads, (head, group.serial))]
        elif group.keys[0] != head:
            self._move_head(head, group, peers)

    def _move_head(self, head: float, group: _Peers, peers: Hashable) -> None:
        del self._heads[bisect.bisect_left(self._heads, (head, group.serial))]
        bisect.insort(self._heads, (group.keys[0], group.serial, peers))

    def choose(
        self,
        request: RequestLoad | None = None,
        eligible: Callable[[str], bool] = _any_instance,
        cached: CachedBlocks = NO_CACHE,
    ) -> DispatchDecision | None:
        if self._policy.prefix_score is None:
            cached = NO_CACHE
        top = self._top(request, cached)
        if top is None:
            return None
        ids, all_busy = top
        rng = self._policy.rng
        if self._policy.top_k == 1:
            chosen = rng.choice(ids)
            if eligible(chosen):
                return DispatchDecision(chosen, all_busy)
        elif all(map(eligible, ids)):
            return DispatchDecision(rng.choice(ids), all_busy)
        # The choice fell on (could fall on) an instance the caller cannot send to: choose again
        # among the eligible instances only. The draw stays uniform among the eligible best.
        top = self._top(request, cached, {iid for iid in self._loads if not eligible(iid)})
        if top is None:
            return None
        ids, all_busy = top
        return DispatchDecision(rng.choice(ids), all_busy)

    def _top(self, request: RequestLoad | None, cached: CachedBlocks, passed_over: Collection[str] = ()
             ) -> tuple[list[str], bool] | None:
        """The ids the choice is drawn from, sorted, and whether they are all busy; None without
        instances.

        First scores every instance with cached blocks of the request (their scores need not follow
        their peers' order), then the others: the instances of each group in bound order, one score
        per bound, the groups in order of their best bound. It stops at a bound below the k best
        scores and not tied with the best (no instance from there on can be chosen), and within a
        group also at a bound further below its k-th scored instance than the tie tolerance (peers
        score no higher than their bounds say)."""
        policy = self._policy
        k = policy.top_k
        exact = policy.bound is None
        # Without a request the bound does not hold (the smallest request still takes a batch slot).
        prune = exact or request is not None
        top_bound = -self._heads[0][0] if self._heads else 0.0
        scored: list[tuple[float, list[str]]] = []  # (score, the sorted ids that have it)
        best = -math.inf
        k_best: list[float] = []  # the k best scores so far, a min-heap

        def out_of_reach(bound: float) -> bool:
            return prune and len(k_best) == k and bound < k_best[0] and not _same(bound, best)

        def below_peers(bound: float, kth_bound: float | None) -> bool:
            # The tie tolerance is at most 1e-9 of the larger score, or 1e-9.
            return prune and kth_bound is not None and \
                kth_bound - bound > 2e-9 * max(1.0, abs(best), abs(top_bound))

        def add(score: float, ids: list[str]) -> None:
            nonlocal best
            scored.append((score, ids))
            best = max(best, score)
            for _ in range(min(len(ids), k)):
                if len(k_best) < k:
                    heapq.heappush(k_best, score)
                elif score > k_best[0]:
                    heapq.heapreplace(k_best, score)

        hit = [iid for iid in cached if iid in self._loads and iid not in passed_over]
        if hit:
            for iid in sorted(hit):
                add(policy.score_cached(self._loads[iid][2], request, cached[iid]), [iid])
            passed_over = {*passed_over, *hit}
        for head, _, peers in self._heads:
            if out_of_reach(-head):
                break
            group = self._peers[peers]
            keys = group.keys
            scored_here = 0
            kth_bound = None  # the bound of the group's k-th scored instance
            at = 0
            while at < len(keys):
                bound = -keys[at]
                if at and (out_of_reach(bound) or below_peers(bound, kth_bound)):
                    break
                end = bisect.bisect_right(keys, keys[at], at)
                ids = group.ids[at:end]
                at = end
                if passed_over:
                    ids = [iid for iid in ids if iid not in passed_over]
                    if not ids:
                        continue
                score = bound if exact else policy.score(self._loads[ids[0]][2], request)
                add(score, ids)
                scored_here += len(ids)
                if scored_here >= k and kth_bound is None:
                    kth_bound = bound
        if not scored:
            return None
        free = [item for item in scored if not policy.is_busy(item[0])]
        candidates = free or scored
        best = max(score for score, _ in candidates)
        tied = [ids for score, ids in candidates if _same(score, best)]
        top = tied[0] if len(tied) == 1 else sorted(itertools.chain.from_iterable(tied))
        if len(top) < k:
            # Within one score the larger ids come first; no more than k of a score can be chosen.
            largest = heapq.nlargest(k, ((score, iid) for score, ids in candidates for iid in ids[-k:]))
            top = sorted(iid for _, iid in largest)
        return top, not free


class RoundRobinPolicy(DispatchPolicy):
    """Cycle through instances in id order, skipping draining ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self.last: str | None = None
        """The instance chosen last; every ranking of this policy continues after it."""

    def ranking(self) -> Ranking:
        return _IdRanking(self)


class _IdRanking(Ranking):
    """Instance ids in order; the policy's cursor moves through them."""

    def __init__(self, policy: RoundRobinPolicy) -> None:
        self._policy = policy
        self._ids: list[str] = []
        """Sorted."""

    def update(self, load: InstanceLoad) -> None:
        if load.draining:
            self.discard(load.instance_id)
            return
        at = bisect.bisect_left(self._ids, load.instance_id)
        if at == len(self._ids) or self._ids[at] != load.instance_id:
            self._ids.insert(at, load.instance_id)

    def discard(self, instance_id: str) -> None:
        at = bisect.bisect_left(self._ids, instance_id)
        if at < len(self._ids) and self._ids[at] == instance_id:
            del self._ids[at]

    def choose(
        self,
        request: RequestLoad | None = None,
        eligible: Callable[[str], bool] = _any_instance,
        cached: CachedBlocks = NO_CACHE,
    ) -> DispatchDecision | None:
        ids = self._ids
        last = self._policy.last
        start = 0 if last is None else bisect.bisect_right(ids, last)
        for at in range(start, start + len(ids)):
            instance_id = ids[at % len(ids)]
            if eligible(instance_id):
                self._policy.last = instance_id
                return DispatchDecision(instance_id)
        return None


def _same(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def queue_freeness(
    load: InstanceLoad,
    request: RequestLoad | None,
    config: LoadModelConfig = DEFAULT_LOAD_MODEL,
    cached_blocks: float = 0.0,
    busy_freeness: float = DEFAULT_BUSY_FREENESS,
) -> float:
    """llumnix's dispatch score: `dispatch_freeness`, except that while an instance has a queue its
    headroom above the busy threshold counts in full only up to `QUEUED_HEADROOM`.

    A request sent behind a queue starts after the queued prefills, however much memory is free. An
    instance that just got a long prompt has a queue and, until that prompt runs, plenty of free
    memory: without this it would draw the next requests of a burst, which would then wait for that
    prefill while other instances have room (measured in the simulator: docs/reproduction.md,
    "Dispatch behind a queue"). The map is increasing and concave (slope 1, then
    `QUEUED_HEADROOM_SLOPE`), so queued instances keep their order, busy stays busy, and peers of
    equal queue state (`queue_peers`) keep the order and spacing the ranking relies on."""
    score = dispatch_freeness(load, request, config, cached_blocks)
    excess = score - busy_freeness - QUEUED_HEADROOM
    if excess <= 0 or not load.waiting:
        return score
    return busy_freeness + QUEUED_HEADROOM + excess * QUEUED_HEADROOM_SLOPE


def queue_peers(load: InstanceLoad) -> Hashable:
    """`dispatch_peers`, split by whether the instance has a queue (`queue_freeness` compresses only
    the queued ones)."""
    return (*dispatch_peers(load), bool(load.waiting))


def prefix_freeness(
    load: InstanceLoad,
    request: RequestLoad | None,
    cached_blocks: float,
    weight: float = DEFAULT_PREFIX_WEIGHT,
    busy_freeness: float = DEFAULT_BUSY_FREENESS,
    config: LoadModelConfig = DEFAULT_LOAD_MODEL,
) -> float:
    """llumnix's score on an instance holding `cached_blocks` of the request's prompt in its cache.

    Memory: the cached blocks are blocks the request does not need there (`dispatch_freeness`).
    Compute: the instance skips that part of the prefill, so its headroom above the busy threshold
    counts 1 + `weight` x (share of the prompt cached) times: with 90% of the prompt cached and weight
    1, another instance wins only with 1.9x the headroom. Below the threshold nothing changes: a hit
    never makes a busy instance look free, and the request still goes where memory is."""
    score = queue_freeness(load, request, config, cached_blocks, busy_freeness)
    if score < busy_freeness or request is None or request.prompt_tokens <= 0:
        return score
    share = min(1.0, cached_blocks * load.block_size / request.prompt_tokens)
    return busy_freeness + (score - busy_freeness) * (1.0 + weight * share)


def make_dispatch_policy(
    name: str,
    *,
    busy_freeness: float = DEFAULT_BUSY_FREENESS,
    top_k: int = 1,
    load_model: LoadModelConfig = DEFAULT_LOAD_MODEL,
    rng: random.Random | None = None,
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
) -> DispatchPolicy:
    """Build a dispatch policy by name (one of POLICY_NAMES). `prefix_weight` (llumnix only): the
    weight of `prefix_freeness` (0: prefix caches are ignored)."""
    if not (prefix_weight >= 0 and math.isfinite(prefix_weight)):
        raise ValueError(f"prefix weight must be a finite number >= 0, got {prefix_weight}")
    if name == "llumnix":
        return ScoringPolicy(
            "llumnix",
            score=lambda load, request: queue_freeness(load, request, load_model, 0.0, busy_freeness),
            bound=lambda load: queue_freeness(load, NO_TOKENS, load_model, 0.0, busy_freeness),
            peers=queue_peers,
            is_busy=lambda score: score < busy_freeness,
            top_k=top_k,
            rng=rng,
            prefix_score=None if prefix_weight == 0 else (
                lambda load, request, blocks: prefix_freeness(
                    load, request, blocks, prefix_weight, busy_freeness, load_model
                )
            ),
        )
    if name == "infaas++":
        return ScoringPolicy(
            "infaas++",
            score=lambda load, _request: -memory_load(load),
            is_busy=lambda score: score <= -1.0,
            top_k=top_k,
            rng=rng,
        )
    if name == "least-requests":
        return ScoringPolicy(
            "least-requests", score=lambda load, _request: -load.num_requests, top_k=top_k, rng=rng
        )
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown dispatch policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
