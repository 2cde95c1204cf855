"""The load model: virtual usage and freeness of an instance, from a snapshot of its engine.

One definition used by the router, the operator's control loop and the simulator.

Units: memory is counted in KV-cache *blocks*. Freeness is blocks of headroom per batched request,
F = (total blocks - sum of virtual usage) / batch size; multiplied by the block size it is the number
of decode steps the instance can still run with its current batch before it runs out of memory.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

DEFAULT_HIGH_PRIORITY_TARGET_TOKENS = 1600
"""Load (tokens) an instance holding high-priority requests is kept near (paper §6.4)."""


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One request as the engine holds it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int = 0
    blocks: int = 0
    """Physical KV blocks the request holds now (0 while it waits)."""
    high_priority: bool = False
    arrival_time: float = 0.0
    """When the instance admitted it (seconds, any monotonic clock); orders 'last-come'."""
    migrating: bool = False
    """True while the request is being migrated out (it must not be picked again)."""
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """A request being dispatched: its prompt's token ids where the router knows them (to look its
    prefix up in the instances' caches); empty otherwise."""
    prefix_root: int = field(default=0, repr=False, compare=False)
    """With `prompt_token_ids`: the root its prompt's block hashes chain from (its cache salt and
    LoRA adapter, `llumnix.prefix_cache.root_hash`; 0 for neither)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """A snapshot of one instance's engine state.

    `running` holds requests with KV blocks (scheduled); `waiting` holds queued requests in queue
    order (the first one is the head of line).
    """

    instance_id: str
    total_blocks: int
    """The blocks requests can be admitted into: an engine that keeps some free when it admits a
    prompt (vLLM v0's 1% watermark, vLLM 0.32's `--watermark`) leaves those out, so that no policy
    counts them as room."""
    free_blocks: int
    block_size: int = 16
    running: tuple[RequestLoad, ...] = ()
    waiting: tuple[RequestLoad, ...] = ()
    draining: bool = False
    """The instance is being emptied (scale-down, maintenance, termination)."""
    preemptions: int = 0
    """Requests preempted since the previous snapshot; an instance that preempts is overloaded."""
    migrating_out: int = 0
    migrating_in: int = 0
    reserved_blocks: int = 0
    """Blocks reserved for migrations coming in (counted as used)."""
    timestamp: float = 0.0
    queued_blocks: int = field(init=False, repr=False, compare=False)
    """Blocks every queued request needs before it can be scheduled (`queued_demand`)."""
    has_high_priority: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Once per snapshot: dispatch reads these for every instance it scores, on every request.
        queued = sum(blocks_for_tokens(r.total_tokens, self.block_size) for r in self.waiting)
        object.__setattr__(self, "queued_blocks", queued)
        high = any(r.high_priority for r in self.running) or any(r.high_priority for r in self.waiting)
        object.__setattr__(self, "has_high_priority", high)

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


@dataclass(frozen=True, slots=True)
class LoadModelConfig:
    high_priority_target_tokens: int = DEFAULT_HIGH_PRIORITY_TARGET_TOKENS


DEFAULT_LOAD_MODEL = LoadModelConfig()


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """KV blocks needed to hold `tokens` tokens."""
    return -(-tokens // block_size) if tokens > 0 else 0


def queued_demand(load: InstanceLoad) -> int:
    """Blocks every queued request needs before it can be scheduled."""
    return load.queued_blocks


def head_of_line_demand(load: InstanceLoad) -> int:
    """Blocks the first queued request needs before it can be scheduled."""
    if not load.waiting:
        return 0
    return blocks_for_tokens(load.waiting[0].total_tokens, load.block_size)


def high_priority_headroom(
    load: InstanceLoad, config: LoadModelConfig = DEFAULT_LOAD_MODEL, incoming: RequestLoad | None = None
) -> int:
    """Blocks reserved on an instance that holds (or is about to get, `incoming`) high-priority
    requests.

    The headroom is what lies above the high-priority load target, so an instance with
    high-priority work looks nearly full: normal requests are dispatched and migrated elsewhere,
    and the high-priority requests decode in a lightly loaded batch.
    """
    if not (load.has_high_priority or (incoming is not None and incoming.high_priority)):
        return 0
    target = blocks_for_tokens(config.high_priority_target_tokens, load.block_size)
    return max(0, load.total_blocks - target)


def virtual_usage(load: InstanceLoad, config: LoadModelConfig = DEFAULT_LOAD_MODEL) -> float:
    """Total virtual usage of an instance in blocks; infinite while draining."""
    if load.draining:
        return math.inf
    physical = load.used_blocks + load.reserved_blocks
    return physical + head_of_line_demand(load) + high_priority_headroom(load, config)


def batch_size(load: InstanceLoad) -> int:
    """Running requests, plus one if anything waits (the head of line joins the batch next)."""
    return len(load.running) + (1 if load.waiting else 0)


def freeness(load: InstanceLoad, config: LoadModelConfig = DEFAULT_LOAD_MODEL) -> float:
    """Blocks of headroom per batched request; -inf while draining. An idle instance reports its
    free blocks (batch size counts as one)."""
    usage = virtual_usage(load, config)
    if math.isinf(usage):
        return -math.inf
    return (load.total_blocks - usage) / max(1, batch_size(load))


def dispatch_freeness(
    load: InstanceLoad,
    request: RequestLoad | None = None,
    config: LoadModelConfig = DEFAULT_LOAD_MODEL,
    cached_blocks: float = 0.0,
) -> float:
    """Freeness the instance would have with `request` admitted behind its whole queue.

    `cached_blocks`: blocks of the request's prompt the instance has in its prefix cache. They are
    blocks the request will not need there, so its demand shrinks by them (never below zero).

    Dispatch looks further ahead than `freeness`: every queued request will need its blocks before
    the new one runs, and each joins the batch. Without this an instance whose few requests nearly
    fill its memory looks free (high blocks per request) to a request that cannot fit there.

    An over-subscribed instance reports its deficit in blocks, not divided by the batch: dividing a
    negative headroom by a larger batch would make the more crowded instance look less overloaded,
    so in a burst requests would pile onto the instances with the longest queues.

    A request never makes an instance look freer than one without tokens does (the dispatch picker
    relies on it to skip instances that cannot win).
    """
    if load.draining:
        return -math.inf
    demand = load.queued_blocks
    batch = load.num_requests
    if request is not None:
        demand += max(0.0, blocks_for_tokens(request.total_tokens, load.block_size) - cached_blocks)
        batch += 1
    headroom = high_priority_headroom(load, config, request)
    room = load.total_blocks - (load.used_blocks + load.reserved_blocks + demand + headroom)
    if room < 0:
        return float(room)
    return room / max(1, batch)


def engine_queues(load: InstanceLoad, request: RequestLoad) -> bool:
    """Whether the instance's engine would queue `request` now: its blocks do not fit beside what the
    instance holds and every request queued ahead of it. Unlike `dispatch_freeness` it counts no
    high-priority headroom: that steers dispatch away from an instance, it does not stop the engine
    from admitting a request."""
    if load.draining:
        return True
    needed = load.used_blocks + load.reserved_blocks + load.queued_blocks + \
        blocks_for_tokens(request.total_tokens, load.block_size)
    return needed > load.total_blocks


def dispatch_peers(load: InstanceLoad) -> tuple[int, bool, int, int]:
    """What `dispatch_freeness` depends on besides the room an instance has left. Loads with the same
    peers get, for every request, dispatch freeness in the order of their freeness for a request
    without tokens, and at least as far apart (the room a request takes is the same for all of them;
    freeness falls no slower as the room shrinks). The dispatch picker relies on it to skip the
    peers of an instance that outranks them."""
    return (load.num_requests, load.has_high_priority, load.total_blocks, load.block_size)


def memory_load(load: InstanceLoad) -> float:
    """Fraction of memory in use or demanded by every queued request (INFaaS++'s load)."""
    if load.draining:
        return math.inf
    return (load.used_blocks + load.reserved_blocks + queued_demand(load)) / max(1, load.total_blocks)


@dataclass(frozen=True, slots=True)
class ClusterDemand:
    """The serving instances' requests seen as one instance's: the KV blocks they hold, reserve or
    wait for (each queued one's whole need, plus the high-priority headroom) and how many they are
    (running and queued). No instance joining or leaving changes it, only load coming or going."""

    blocks: float = 0.0
    requests: int = 0

    def freeness(self, capacity: float) -> float:
        return (capacity - self.blocks) / max(1, self.requests)


def cluster_demand(loads: Iterable[InstanceLoad], config: LoadModelConfig = DEFAULT_LOAD_MODEL,
                   held_tokens: Collection[int] = ()) -> ClusterDemand:
    """The demand of the instances that are not draining (a draining one's requests are leaving),
    plus the requests the routers hold (`held_tokens`: the tokens each needs; held while every
    instance is busy, they sit in no instance's queue yet and count as queued ones)."""
    loads = list(loads)
    block_size = next((load.block_size for load in loads), 0)
    blocks = float(sum(blocks_for_tokens(tokens, block_size) for tokens in held_tokens) if block_size else 0)
    requests = len(held_tokens)
    for load in loads:
        if load.draining:
            continue
        blocks += load.used_blocks + load.reserved_blocks + queued_demand(load)
        blocks += high_priority_headroom(load, config)
        requests += len(load.running) + len(load.waiting)
    return ClusterDemand(blocks, requests)


def aggregate_freeness(
    loads: Iterable[InstanceLoad],
    config: LoadModelConfig = DEFAULT_LOAD_MODEL,
    exclude_capacity_of: str | None = None,
    added_blocks: int = 0,
) -> float:
    """Freeness of the cluster seen as one instance, for capacity planning (autoscaling).

    The whole backlog counts: every queued request's blocks are usage and every queued request is
    in the batch, as in the Llumnix artifact's scaling load (`cluster_demand`). An instance's own
    freeness looks only at its head of line (what its next iterations face), but instances to add or
    remove must cover every queued request; counting only each queue's head hid a backlog of dozens
    of requests. Draining instances count neither capacity nor batch (their requests are leaving);
    `exclude_capacity_of` removes one instance's capacity but keeps its requests (the cluster after
    that instance is drained); `added_blocks` is capacity not serving yet (instances starting)."""
    serving = [load for load in loads if not load.draining]
    capacity = added_blocks + sum(load.total_blocks for load in serving
                                  if load.instance_id != exclude_capacity_of)
    return cluster_demand(serving, config).freeness(capacity)


def without_requests(load: InstanceLoad, request_ids: Collection[str]) -> InstanceLoad:
    """The snapshot with requests that ended since it was taken taken out; their blocks are free
    again. The router learns that a request ended (its stream closed) before the next snapshot says
    so; a queue held in the router would otherwise wait one snapshot for every freed slot."""
    if not request_ids:
        return load
    running = tuple(r for r in load.running if r.request_id not in request_ids)
    freed = sum(r.blocks for r in load.running if r.request_id in request_ids)
    waiting = tuple(r for r in load.waiting if r.request_id not in request_ids)
    return replace(load, running=running, waiting=waiting,
                   free_blocks=min(load.total_blocks, load.free_blocks + freed))


def with_pending(load: InstanceLoad, pending: Sequence[RequestLoad]) -> InstanceLoad:
    """The snapshot as it will look once requests dispatched since it was taken arrive: they join
    the waiting queue. The router uses this so a burst does not herd onto one instance."""
    if not pending:
        return load
    return replace(load, waiting=load.waiting + tuple(pending))
