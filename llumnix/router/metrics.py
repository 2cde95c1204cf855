"""The router's Prometheus metrics (one registry per router, so several can live in one process).

Router workers (`llumnix.router.workers`) share their metrics through prometheus_client's
multiprocess mode: counters and histograms are summed over the workers, the queue and in-flight
gauges too, and the instance counts are the largest any worker sees."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("llumnix_router_time_to_first_token_seconds",
                              "Arrival at the router to the first token sent to the client",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llumnix_router_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("llumnix_router_e2e_latency_seconds", "Arrival to the last byte of the response",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("llumnix_router_requests", "Finished requests by HTTP status and by the "
                                "instance that finished them ('none': never dispatched)",
                                ["status", "instance_id"], registry=r)
        self.queue_length = Gauge("llumnix_router_queue_length",
                                  "Requests held by the router while every instance is busy", registry=r,
                                  multiprocess_mode="livesum")
        self.in_flight = Gauge("llumnix_router_in_flight_requests", "Requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.dispatch_seconds = Histogram("llumnix_router_dispatch_decision_seconds",
                                          "Time to choose an instance (loads + policy)",
                                          buckets=_DECISION_BUCKETS, registry=r)
        self.retries = Counter("llumnix_router_retries", "Requests re-sent to another instance before "
                               "their first token", registry=r)
        self.replays = Counter("llumnix_router_replays", "Requests resumed on another instance by token "
                               "replay after a failure", registry=r)
        self.moves = Counter("llumnix_router_moves_followed", "Migrated requests whose stream the router "
                             "continued from the new instance", registry=r)
        self.instances = Gauge("llumnix_router_instances", "Instances by load stream state", ["state"],
                               registry=r, multiprocess_mode="max")

    def exposition(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            shared = CollectorRegistry()
            MultiProcessCollector(shared)
            return generate_latest(shared)
        return generate_latest(self.registry)
