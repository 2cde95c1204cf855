"""The simulated cluster: a discrete-event loop in virtual time over simulated instances.

Events (a heap of (time, sequence, handler, argument)):
- arrivals, read in time order from the trace and dispatched with `llumnix.policies.dispatch`;
- the end of an instance's iteration (the instance then plans its next one);
- the control tick every `migration_interval_s`: migration pairing and request selection with
  `llumnix.policies.migration` (systems that migrate), then a fragmentation sample;
- the end of a migration stage (`llumnix.sim.migration`);
- the autoscaling tick every `autoscaling.interval_s`: releases of drained instances parked for
  `autoscaling.park_s` (`llumnix.policies.autoscaling.release_due`), then
  `llumnix.policies.autoscaling.decide` (a drain only once it has been wanted for
  `scale_down_stabilization_s`, as in the operator); and the moment a started instance becomes ready.
The loop ends when every request has finished.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from llumnix.load import ClusterDemand, RequestLoad, blocks_for_tokens, engine_queues
from llumnix.policies.autoscaling import decide, drained_empty, release_due
from llumnix.policies.dispatch import dispatch_held, make_dispatch_policy, placement
from llumnix.policies.migration import admits, pair_migrations, select_request, with_held_requests
from llumnix.prefix_cache import PrefixIndex, block_hashes, cacheable_blocks
from llumnix.profile import LatencyProfile
from llumnix.sim.instance import EngineConfig, SimInstance
from llumnix.sim.metrics import SimResult, fragmented_blocks
from llumnix.sim.migration import Migration, Outcome
from llumnix.sim.request import SimRequest
from llumnix.sim.systems import SimConfig, SystemSpec
from llumnix.traces import TraceRequest, request_token_ids

Progress = Callable[[float, int], None]
"""(virtual time, finished requests) -> None, called now and then during a run."""

_PROGRESS_EVERY = 20_000


class Cluster:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        system: SystemSpec,
        profile: LatencyProfile,
        instances: int,
        config: SimConfig | None = None,
        seed: int = 0,
    ) -> None:
        if instances < 1:
            raise ValueError("the cluster needs at least one instance")
        config = config or SimConfig()
        self.system = system
        self.profile = profile
        self.config = config
        self.engine = EngineConfig(
            total_blocks=profile.total_blocks,
            block_size=profile.block_size,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            watermark=config.watermark,
            chunked_prefill_tokens=config.chunked_prefill_tokens,
            prefix_caching=config.prefix_caching,
            queue_passing=config.queue_passing,
        )
        capacity = self.engine.admission_blocks * profile.block_size
        too_long = [t for t in trace if t.prompt_tokens + t.output_tokens > capacity]
        if too_long:
            raise ValueError(
                f"{len(too_long)} request(s) need more than one instance's KV capacity ({capacity} tokens),"
                f" e.g. request {too_long[0].request_id} with {too_long[0].prompt_tokens} +"
                f" {too_long[0].output_tokens} tokens"
            )
        self.requests = [
            SimRequest(
                str(t.request_id),
                t.arrival_time,
                t.prompt_tokens,
                t.output_tokens,
                trace_high_priority=t.high_priority,
                high_priority=t.high_priority and system.priorities,
                block_hashes=block_hashes(request_token_ids(t), profile.block_size)
                if t.segments and config.prefix_caching else None,
            )
            for t in sorted(trace, key=lambda t: (t.arrival_time, t.request_id))
        ]
        self.dispatcher = make_dispatch_policy(
            system.dispatch,
            top_k=config.dispatch_top_k,
            load_model=config.load_model,
            rng=random.Random(seed),
            prefix_weight=system.prefix_weight,
        )
        self.prefix_index = PrefixIndex()
        """What every instance has cached, kept from the changes they report (as the router does)."""
        scaling = config.autoscaling
        if scaling is not None:
            instances = min(max(instances, scaling.min_instances, 1), scaling.max_instances)
        self._next_instance = 0
        self.ready: list[SimInstance] = [self._new_instance() for _ in range(instances)]
        self.starting: list[SimInstance] = []
        self.released: list[SimInstance] = []
        self.pending: list[SimRequest] = []
        """Arrived while no instance could take them (all starting or draining) or, for a system
        whose router holds requests, while every instance was busy; in the router's order."""
        self._passed_at: dict[str, float] = {}
        """Held requests that a request behind them was dispatched ahead of, and since when."""
        self._drain_wanted_since: float | None = None
        self._empty_since: dict[str, float] = {}
        """Drained instances found empty at an autoscaling tick (parked), and since when."""
        self._last_demand: ClusterDemand | None = None
        """The previous autoscaling decision's demand (`decide`'s `previous`)."""
        self._heap: list[tuple[float, int, Callable[[Any, float], None], Any]] = []
        self._seq = 0
        self.now = 0.0
        self.finished = 0
        self._instance_area = 0.0
        self._instance_changed_at = 0.0
        self.result = SimResult(system=system.name, requests=self.requests, duration=0.0, avg_instances=0.0)
        self._record_instances()

    # ----- plumbing -----

    def _new_instance(self) -> SimInstance:
        instance = SimInstance(f"i{self._next_instance:03d}", self.engine, self.profile.iteration_time)
        self._next_instance += 1
        return instance

    def _push(self, at: float, handler: Callable[[Any, float], None], arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, handler, arg))

    def _record_instances(self) -> None:
        counts = self.result.instance_counts
        if counts:
            self._instance_area += counts[-1] * (self.now - self._instance_changed_at)
        self._instance_changed_at = self.now
        self.result.instance_times.append(self.now)
        counts.append(len(self.ready) + len(self.starting))

    def _kick(self, instance: SimInstance) -> None:
        if instance.busy:
            return
        duration = instance.plan(self.now)
        if duration is not None:
            self._push(self.now + duration, self._on_iteration_end, instance)

    # ----- the loop -----

    def run(self, progress: Progress | None = None) -> SimResult:
        started = time.perf_counter()
        requests = self.requests
        total = len(requests)
        self._push(self.config.migration_interval_s, self._on_tick)
        if self.config.autoscaling is not None:
            self._push(self.config.autoscaling.interval_s, self._on_autoscale)
        heap = self._heap
        pop = heapq.heappop
        next_arrival = 0
        events = 0
        while self.finished < total:
            arrival_time = requests[next_arrival].arrival_time if next_arrival < total else math.inf
            if heap and heap[0][0] <= arrival_time:
                at, _, handler, arg = pop(heap)
                self.now = at
                handler(arg, at)
            else:
                self.now = arrival_time
                self._dispatch(requests[next_arrival])
                next_arrival += 1
            events += 1
            if progress is not None and events % _PROGRESS_EVERY == 0:
                progress(self.now, self.finished)
        if progress is not None:
            progress(self.now, self.finished)
        self._record_instances()
        result = self.result
        result.duration = self.now
        result.avg_instances = self._instance_area / self.now if self.now > 0 else float(len(self.ready))
        result.preemptions = sum(i.preemptions for i in self._all_instances_ever)
        result.prefix_hit_tokens = sum(i.prefix_hit_tokens for i in self._all_instances_ever)
        result.events = events
        result.wall_seconds = time.perf_counter() - started
        return result

    @property
    def _all_instances_ever(self) -> list[SimInstance]:
        return self.released + self.ready + self.starting

    # ----- handlers -----

    def _cached_blocks(self, request: SimRequest) -> dict[str, int]:
        """The request's prompt blocks each instance has cached (as its reports say)."""
        if not request.block_hashes:
            return {}
        index = self.prefix_index
        for instance in self.ready:
            if instance.cache is not None:
                stored, removed = instance.cache.take_changes()
                if stored or removed:
                    index.apply(instance.instance_id, stored, removed)
        return index.cached_blocks(
            request.block_hashes[: cacheable_blocks(request.prompt_tokens, self.engine.block_size)]
        )

    def _dispatch(self, request: SimRequest) -> None:
        if self.pending and self.system.holds:
            self._hold(request)  # offered with the held ones, in their order (as the router's queue does)
            self._dispatch_pending()
        elif not self._place(request):
            self._hold(request)

    def _place(self, request: SimRequest) -> bool:
        """Dispatches the request unless it is to be held (no instance serves, or, for a system
        whose router holds requests, every instance is busy)."""
        incoming = RequestLoad(
            request.request_id, request.prompt_tokens, request.generated, high_priority=request.high_priority
        )
        cached = self._cached_blocks(request)
        decision = self.dispatcher.choose([instance.snapshot() for instance in self.ready], incoming, cached)
        if self.system.holds:  # the callbacks run only when every instance is busy
            chosen = placement(decision,
                               lambda iid: engine_queues(self._ready(iid).snapshot(), incoming),
                               lambda iid: self._ready(iid).num_requests == 0,
                               (i.instance_id for i in self.ready if not i.draining and i.num_requests == 0),
                               self.now - self._passed_at.get(request.request_id, self.now))
        else:
            chosen = None if decision is None else decision.instance_id
        if chosen is None:
            return False
        self._passed_at.pop(request.request_id, None)
        request.best_cached_blocks = max(cached.values(), default=0)
        request.dispatched_cached_blocks = cached.get(chosen, 0)
        instance = self._ready(chosen)
        instance.enqueue(request)
        self._kick(instance)
        return True

    def _ready(self, instance_id: str) -> SimInstance:
        return next(i for i in self.ready if i.instance_id == instance_id)

    def _hold(self, request: SimRequest) -> None:
        """Queue it here until an instance can take it: high priority first, then arrival (the
        router's order)."""
        bisect.insort(self.pending, request, key=_held_order)

    def _on_iteration_end(self, instance: SimInstance, now: float) -> None:
        completed = len(instance.complete(now))
        self.finished += completed
        self._kick(instance)
        if completed:
            self._wake()

    def _on_tick(self, _: None, now: float) -> None:
        if self.system.migration:
            self._migration_round()
        self._wake()  # one passed for `MAX_HOLD_S` goes to the chosen instance even if no room was freed
        for instance in self.ready:
            instance.read_preemptions()
        self._sample_fragmentation()
        if self.finished < len(self.requests):
            self._push(now + self.config.migration_interval_s, self._on_tick)

    def _migration_round(self) -> None:
        # At most one held request per instance counts (`with_held_requests`).
        held = [request.tokens for request in self.pending[: len(self.ready)]] if self.system.holds else []
        loads = with_held_requests([instance.snapshot() for instance in self.ready], held)
        by_id = {instance.instance_id: instance for instance in self.ready}
        load_by_id = {load.instance_id: load for load in loads}
        for pair in pair_migrations(loads, self.config.migration, self.config.load_model):
            chosen = select_request(load_by_id[pair.source], self.config.migration.select)
            if chosen is None or not admits(
                chosen, load_by_id[pair.destination], self.config.migration, self.config.load_model
            ):
                continue
            source = by_id[pair.source]
            request = next((r for r in source.running if r.request_id == chosen.request_id), None)
            if request is None:
                continue  # still prefilling: only decoding requests can move
            migration = Migration(
                request,
                source,
                by_id[pair.destination],
                self.profile.kv_transfer_time,
                self.config.max_migration_stages,
            )
            stage_end = migration.start(self.now)
            if stage_end is not None:
                self._push(stage_end, self._on_migration_stage, migration)

    def _on_migration_stage(self, migration: Migration, now: float) -> None:
        stage_end = migration.on_stage_end(now)
        if stage_end is not None:
            self._push(stage_end, self._on_migration_stage, migration)
            return
        if migration.outcome is Outcome.COMPLETED:
            self.result.migration_downtimes.append(migration.downtime)
            self.result.migration_stages.append(migration.stages)
            self._kick(migration.destination)
        else:
            self.result.migrations_aborted += 1
        self._kick(migration.source)
        self._wake()

    def _sample_fragmentation(self) -> None:
        free = 0
        total = 0
        demands = []
        for instance in self.ready:
            free += instance.free_blocks
            total += instance.total_blocks
            demand = instance.head_of_line_blocked_demand()
            if demand:
                demands.append(demand)
        # A request the router holds is blocked as an instance's head of line is.
        demands.extend(blocks_for_tokens(request.tokens, self.engine.block_size) for request in self.pending)
        self.result.fragmentation_times.append(self.now)
        self.result.fragmentation.append(fragmented_blocks(free, demands) / total if total else 0.0)

    def _on_autoscale(self, _: None, now: float) -> None:
        scaling = self.config.autoscaling
        assert scaling is not None
        self._release_parked(now, scaling.park_s)
        action = decide(
            [instance.snapshot() for instance in self.ready],
            len(self.starting),
            scaling,
            self.config.load_model,
            self._last_demand,
            [request.tokens for request in self.pending],
        )
        self._last_demand = action.demand
        drain_wanted_for = 0.0
        if action.kind != "drain":
            self._drain_wanted_since = None
        else:
            if self._drain_wanted_since is None:
                self._drain_wanted_since = now
            drain_wanted_for = now - self._drain_wanted_since
        if action.kind == "drain" and drain_wanted_for < self.config.scale_down_stabilization_s:
            pass  # not wanted for long enough yet
        elif action.kind in ("drain", "cancel-drain"):
            self._drain_wanted_since = None
            instance = next(i for i in self.ready if i.instance_id == action.instance_id)
            instance.set_draining(action.kind == "drain")
            if action.kind == "cancel-drain":
                self._dispatch_pending()
        # A scale-up's instances, or those a cancel-drain starts besides the one it put back.
        for _ in range(action.starts):
            instance = self._new_instance()
            self.starting.append(instance)
            self._push(now + scaling.startup_delay_s, self._on_instance_ready, instance)
        if action.starts:
            self._record_instances()
        if self.finished < len(self.requests):
            self._push(now + scaling.interval_s, self._on_autoscale)

    def _release_parked(self, now: float, park_s: float) -> None:
        empty_since = {}
        for instance in list(self.ready):
            if not drained_empty(instance.snapshot()):
                continue
            since = empty_since[instance.instance_id] = self._empty_since.get(instance.instance_id, now)
            if release_due(since, now, park_s):
                del empty_since[instance.instance_id]
                self.ready.remove(instance)
                self.released.append(instance)
                self.prefix_index.drop(instance.instance_id)
                self._record_instances()
        self._empty_since = empty_since

    def _on_instance_ready(self, instance: SimInstance, now: float) -> None:
        self.starting.remove(instance)
        self.ready.append(instance)
        self._dispatch_pending()

    def _dispatch_pending(self) -> None:
        self.pending = dispatch_held(self.pending, lambda r: r.tokens, lambda r: r.high_priority, self._place,
                                     lambda r: self._passed_at.setdefault(r.request_id, self.now))

    def _wake(self) -> None:
        """After room was freed and at every tick: a system whose router holds requests offers them
        again (the router does at every load update)."""
        if self.pending and self.system.holds:
            self._dispatch_pending()


def _held_order(request: SimRequest) -> tuple[bool, float]:
    return (not request.high_priority, request.arrival_time)
