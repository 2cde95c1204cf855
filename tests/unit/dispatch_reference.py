"""Random loads and requests, and the dispatch picker written the straightforward way (score every
instance, then take the best and its ties, or the k best), for tests to compare the real one with."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import replace

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.policies.dispatch import ScoringPolicy


def random_request(rng: random.Random, request_id: str = "new") -> RequestLoad:
    return RequestLoad(request_id, rng.choice([0, 1, 16, 17, rng.randint(0, 900)]), rng.randint(0, 40),
                       high_priority=rng.random() < 0.2)


def random_load(rng: random.Random, instance_id: str, scale: int = 1) -> InstanceLoad:
    """Small ranges, so that loads often tie or are peers; `scale` multiplies the memory (a large
    one makes different rooms nearly equal freeness)."""
    block_size = rng.choice([16, 32])
    running = tuple(RequestLoad(f"{instance_id}-r{i}", rng.randint(1, 300), rng.randint(0, 50),
                                blocks=rng.randint(0, 12), high_priority=rng.random() < 0.05)
                    for i in range(rng.randint(0, 4)))
    waiting = tuple(RequestLoad(f"{instance_id}-w{i}", rng.choice([16, 160, rng.randint(1, 2000)]),
                                high_priority=rng.random() < 0.05)
                    for i in range(rng.choice([0, 0, 1, 2, 3])))
    total = rng.choice([100, 120]) * scale
    used = sum(r.blocks for r in running) + rng.choice([0, 0, rng.randint(0, 20)])
    return InstanceLoad(instance_id, total, max(0, total - used), block_size, running, waiting,
                        draining=rng.random() < 0.05, reserved_blocks=rng.choice([0, 0, rng.randint(0, 30)]))


def random_loads(rng: random.Random, count: int, scale: int = 1) -> list[InstanceLoad]:
    """Loads of instances "i0", "i1", ...; some are copies of an earlier one (exact ties)."""
    loads: list[InstanceLoad] = []
    for i in range(count):
        if loads and rng.random() < 0.3:
            loads.append(replace(rng.choice(loads), instance_id=f"i{i}"))
        else:
            loads.append(random_load(rng, f"i{i}", scale))
    return loads


def _same(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def reference_top(policy: ScoringPolicy, loads: Sequence[InstanceLoad], request: RequestLoad | None
                  ) -> tuple[list[str], bool] | None:
    """The sorted ids a choice is drawn from, and whether every candidate is busy."""
    scored = [(policy.score(load, request), load.instance_id) for load in loads if not load.draining]
    if not scored:
        return None
    free = [item for item in scored if not policy.is_busy(item[0])]
    candidates = free or scored
    best = max(score for score, _ in candidates)
    top = [iid for score, iid in candidates if _same(score, best)]
    if len(top) < policy.top_k:
        top = [iid for _, iid in heapq.nlargest(policy.top_k, candidates)]
    return sorted(top), not free


def reference_choice(policy: ScoringPolicy, loads: Sequence[InstanceLoad], request: RequestLoad | None,
                     rng: random.Random) -> tuple[str, bool] | None:
    top = reference_top(policy, loads, request)
    if top is None:
        return None
    ids, all_busy = top
    return rng.choice(ids), all_busy
