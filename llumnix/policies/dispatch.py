"""Dispatch policies: choose the instance for a new request.

A small framework in the style of llm-d's scheduler: each policy is a pure `score(load) -> float`
(higher is better) plus an optional filter, and one picker that takes the best score with a random
tie-break among the top k. Round-robin is the one stateful policy (a cursor).
"""

from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llumnix.load import (
    DEFAULT_LOAD_MODEL,
    InstanceLoad,
    LoadModelConfig,
    RequestLoad,
    dispatch_freeness,
    memory_load,
)

POLICY_NAMES = ("llumnix", "infaas++", "round-robin", "least-requests")

DEFAULT_BUSY_FREENESS = 0.0
"""Below this freeness an instance is busy: a new request would wait in its queue."""


@dataclass(frozen=True, slots=True)
class DispatchDecision:
    instance_id: str
    all_busy: bool = False
    """Every candidate was busy: the request will queue (the router may hold it instead)."""


class DispatchPolicy(ABC):
    """Choose an instance for a request. Draining instances are never chosen; None means there
    is no instance to choose."""

    name: str = ""

    @abstractmethod
    def choose(
        self, loads: Sequence[InstanceLoad], request: RequestLoad | None = None
    ) -> DispatchDecision | None: ...


class ScoringPolicy(DispatchPolicy):
    """Highest score wins; ties (and the top k when k > 1) are broken at random."""

    def __init__(
        self,
        name: str,
        score: Callable[[InstanceLoad, RequestLoad | None], float],
        is_busy: Callable[[float], bool] = lambda _score: False,
        top_k: int = 1,
        rng: random.Random | None = None,
    ) -> None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.name = name
        self.score = score
        self.is_busy = is_busy
        self.top_k = top_k
        self.rng = rng or random.Random(0)

    def choose(
        self, loads: Sequence[InstanceLoad], request: RequestLoad | None = None
    ) -> DispatchDecision | None:
        scored = [(self.score(load, request), load.instance_id) for load in loads if not load.draining]
        if not scored:
            return None
        free = [item for item in scored if not self.is_busy(item[0])]
        candidates = free or scored
        # Linear in the instances: the router decides over every instance on every request.
        best = max(score for score, _ in candidates)
        top = [iid for score, iid in candidates if _same(score, best)]
        if len(top) < self.top_k:
            top = [iid for _, iid in heapq.nlargest(self.top_k, candidates)]
        return DispatchDecision(self.rng.choice(sorted(top)), all_busy=not free)


class RoundRobinPolicy(DispatchPolicy):
    """Cycle through instances in id order, skipping draining ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(
        self, loads: Sequence[InstanceLoad], request: RequestLoad | None = None
    ) -> DispatchDecision | None:
        ids = sorted(load.instance_id for load in loads if not load.draining)
        if not ids:
            return None
        nxt = next((iid for iid in ids if self._last is None or iid > self._last), ids[0])
        self._last = nxt
        return DispatchDecision(nxt)


def _same(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def make_dispatch_policy(
    name: str,
    *,
    busy_freeness: float = DEFAULT_BUSY_FREENESS,
    top_k: int = 1,
    load_model: LoadModelConfig = DEFAULT_LOAD_MODEL,
    rng: random.Random | None = None,
) -> DispatchPolicy:
    """Build a dispatch policy by name (one of POLICY_NAMES)."""
    if name == "llumnix":
        return ScoringPolicy(
            "llumnix",
            score=lambda load, request: dispatch_freeness(load, request, load_model),
            is_busy=lambda score: score < busy_freeness,
            top_k=top_k,
            rng=rng,
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
