"""Migration policy: which instances exchange requests, and which request moves.

Pairing runs every migration interval over all snapshots: sources are instances whose freeness is
below the threshold (draining instances have -inf freeness, instances that preempted are overloaded
whatever their freeness), most loaded first; destinations are the freest instances whose freeness is
at or above the destination floor. The source's llumlet then picks the request with
`select_request`, and the destination takes it only if it `admits` it: with the request added, the
destination's freeness must still be at or above the floor.

Why a floor above the source threshold: a migration moves memory, it creates none. When it spends a
destination's last headroom, the next burst of arrivals queues there instead of on the source (the
cluster, kept free of preemptions, has no slack left), and the destination becomes a source itself a
few dozen decode steps later. A destination must stay free after the move, by the autoscaler's
measure of a short instance (docs/simulator.md, "The migration rule").

Requests the routers hold are in no instance's load; `with_held_requests` queues them where they would
go before pairing, so migration does not fill the room they wait for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from llumnix.load import DEFAULT_LOAD_MODEL, InstanceLoad, LoadModelConfig, RequestLoad, freeness

SELECT_POLICIES = ("last-come", "shortest", "longest")
DEFAULT_DESTINATION_FREENESS = 10.0
"""The autoscaler's scale-up bound: a migration destination must stay at or above it."""


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    freeness_threshold: float = 3.0
    """Sources are below it (blocks per batched request)."""
    destination_freeness: float = DEFAULT_DESTINATION_FREENESS
    """A destination's freeness with the migrated request added must stay at or above it (the
    autoscaler's scale-up bound: below it an instance's capacity is short)."""
    select: str = "last-come"
    max_concurrent_per_instance: int = 1
    """Migrations an instance takes part in at once (in and out together)."""

    def __post_init__(self) -> None:
        if self.select not in SELECT_POLICIES:
            raise ValueError(f"unknown request selection {self.select!r}; choose one of {SELECT_POLICIES}")
        if self.max_concurrent_per_instance < 1:
            raise ValueError("max_concurrent_per_instance must be >= 1")
        if self.destination_freeness < self.freeness_threshold:
            raise ValueError("destination_freeness must be >= freeness_threshold")

    @classmethod
    def with_threshold(cls, freeness_threshold: float, select: str = "last-come",
                       max_concurrent_per_instance: int = 1) -> MigrationConfig:
        """The configuration for a source threshold a user chose: the destination bound stays the
        default (the scale-up bound) unless the threshold is above it, which raises the bound."""
        bound = max(DEFAULT_DESTINATION_FREENESS, freeness_threshold)
        return cls(freeness_threshold, bound, select, max_concurrent_per_instance)


DEFAULT_MIGRATION = MigrationConfig()


@dataclass(frozen=True, slots=True)
class MigrationPair:
    source: str
    destination: str


def migratable(load: InstanceLoad) -> list[RequestLoad]:
    """Running requests that may move now.

    High-priority requests are not moved off to make room for normal ones: while an instance holds
    normal requests, only those are candidates (which also moves normal work away from high-priority
    requests). Only when nothing but high-priority requests remain may those move.
    """
    running = [r for r in load.running if not r.migrating and r.blocks > 0]
    normal = [r for r in running if not r.high_priority]
    return normal or running


def is_source(load: InstanceLoad, config: MigrationConfig, model: LoadModelConfig) -> bool:
    return load.draining or load.preemptions > 0 or freeness(load, model) < config.freeness_threshold


def _busy(load: InstanceLoad, config: MigrationConfig) -> bool:
    return load.migrating_out + load.migrating_in >= config.max_concurrent_per_instance


def held_requests_apply(loads: Sequence[InstanceLoad]) -> bool:
    """Whether `with_held_requests` queues held requests on these loads: not while an instance drains."""
    return not any(load.draining for load in loads)


def with_held_requests(loads: Sequence[InstanceLoad], held_tokens: Sequence[int]) -> list[InstanceLoad]:
    """The loads with the requests the routers hold queued on them as engines' queues would hold them:
    each held request (`held_tokens`: the tokens each needs, in the order the routers offer them) at a
    different serving instance, the instances with the most room left first.

    A held request is in no instance's load. Pairing without it sees the instance whose finishing
    requests free room for a held request as free, moves requests into it and fills that room; with
    it, the held request is that instance's head of line and counts in its virtual usage, as a queued
    request does: the instance is no destination, and while its freeness is low it is a source, whose
    requests moving out free the room sooner (docs/reproduction.md, "Migration while the router holds
    requests").

    While an instance drains, the loads are left as they are: its requests have the first claim on the
    room elsewhere. The drain removes capacity that the autoscaler or an operator decided to remove, and
    a held request waits for room either way; queued where it would go, it would leave the draining
    instance no destination."""
    if not held_tokens or not held_requests_apply(loads):
        return list(loads)
    by_room = sorted(loads, key=lambda load: (load.queued_blocks + load.reserved_blocks - load.free_blocks,
                                              load.instance_id))
    queued = {load.instance_id: replace(load, waiting=(*load.waiting, RequestLoad(f"held-{at}", tokens)))
              for at, (tokens, load) in enumerate(zip(held_tokens, by_room, strict=False))}
    return [queued.get(load.instance_id, load) for load in loads]


def pair_migrations(
    loads: Sequence[InstanceLoad],
    config: MigrationConfig = DEFAULT_MIGRATION,
    model: LoadModelConfig = DEFAULT_LOAD_MODEL,
) -> list[MigrationPair]:
    """Pair overloaded instances (most loaded first) with the freest ones, one pair each."""
    sources: list[tuple[float, str]] = []
    destinations: list[tuple[float, str]] = []
    for load in loads:
        if _busy(load, config):
            continue
        f = freeness(load, model)
        if is_source(load, config, model):
            if migratable(load):
                sources.append((f, load.instance_id))
        elif not load.draining and f >= config.destination_freeness:
            destinations.append((f, load.instance_id))
    sources.sort()
    destinations.sort(key=lambda fd: (-fd[0], fd[1]))
    return [
        MigrationPair(src, dst)
        for (src_f, src), (dst_f, dst) in zip(sources, destinations, strict=False)
        if dst_f > src_f
    ]


def select_request(load: InstanceLoad, policy: str = "last-come") -> RequestLoad | None:
    """The request the source moves out: the latest admitted, the shortest or the longest
    (by tokens). Short requests move fastest; the latest has the least progress at stake."""
    candidates = migratable(load)
    if not candidates:
        return None
    if policy == "last-come":
        return max(candidates, key=lambda r: (r.arrival_time, r.request_id))
    if policy == "shortest":
        return min(candidates, key=lambda r: (r.total_tokens, r.request_id))
    if policy == "longest":
        return max(candidates, key=lambda r: (r.total_tokens, r.request_id))
    raise ValueError(f"unknown request selection {policy!r}; choose one of {SELECT_POLICIES}")


def fits(request: RequestLoad, destination: InstanceLoad) -> bool:
    """Destination-side admission check of the migration handshake: a serving instance with room
    for the request's blocks plus one block of growth (it keeps decoding while it moves)."""
    if destination.draining:
        return False
    return destination.free_blocks - destination.reserved_blocks >= request.blocks + 1


def admits(
    request: RequestLoad,
    destination: InstanceLoad,
    config: MigrationConfig = DEFAULT_MIGRATION,
    model: LoadModelConfig = DEFAULT_LOAD_MODEL,
) -> bool:
    """Whether the destination should take `request`: it `fits`, and the destination's freeness with
    the request added stays at or above `destination_freeness`.

    Pairing judges a destination before the request is known; without this check a large request
    can fill the destination, block its own head-of-line request and the arrivals dispatched to it,
    and turn it into a source (the Llumnix artifact's pairing checks the load after migration too).
    """
    if not fits(request, destination):
        return False
    after = replace(
        destination,
        free_blocks=destination.free_blocks - request.blocks,
        running=(*destination.running, replace(request, migrating=False)),
    )
    return freeness(after, model) >= config.destination_freeness
