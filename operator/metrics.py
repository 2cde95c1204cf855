"""The operator's Prometheus metrics (served with its readiness on `--metrics-port`, see
`llumnix_operator.http_endpoint`).

Per-LLMService figures come from the status snapshot each daemon publishes every tick, so a scrape
(on the HTTP server's thread) never reads the control loop's live state. Labels name the object
`llmservice_namespace` and `llmservice`: a ServiceMonitor's target labels already include
`namespace` (the operator pod's) and `instance`, and Prometheus would rename clashing ones."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llumnix.control.migration_pass import outcome_name
from llumnix.control.status import ServiceStatus
from llumnix.v1 import migration_pb2 as mpb

PREFIX = "llumnix_operator"
SERVICE_LABELS = ["llmservice_namespace", "llmservice"]

SCALING_DIRECTION = {
    "ScaledUp": "up",
    "DrainCancelled": "up",
    "Draining": "down",
    "ScaledDown": "down",
    "Released": "down",
    "DrainTimeout": "down",
    "InstanceFailed": "replace",
    "Replaced": "replace",
    "RollingUpdate": "replace",
}
"""Direction of each control-loop event that changes the instance set (the event reason is the
`reason` label)."""

MIGRATION_OUTCOMES = tuple(outcome_name(v.number) for v in mpb.MigrationOutcome.DESCRIPTOR.values
                           if v.number != mpb.MIGRATION_OUTCOME_UNSPECIFIED)
"""Outcomes a llumlet answers, exported from the start (at 0): a counter series born at its first
event has no increase for rate() to show, so a service's first migration would be missing."""

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _ServicesCollector(Collector):
    def __init__(self, snapshots: dict[tuple[str, str], ServiceStatus | None], lock: threading.Lock) -> None:
        self._snapshots = snapshots
        self._lock = lock

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshots = dict(self._snapshots)
        gauges = {
            "desired_instances": "Instances the control loop aims at",
            "ready_instances": "Engine pods that are READY (draining ones included)",
            "serving_instances": "READY engine pods that are not draining (they receive requests)",
            "draining_instances": "Engine pods being drained by migration",
            "aggregate_freeness": "The serving instances' aggregate freeness (free KV blocks per batched "
            "request, the whole backlog counted): the autoscaler's signal; absent without load",
            "spec_valid": "1 while the spec is acted on, 0 while it is invalid (the last valid "
            "settings stay in force)",
        }
        families = {name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=SERVICE_LABELS)
                    for name, doc in gauges.items()}
        migrations = CounterMetricFamily(f"{PREFIX}_migrations", "Migrations the control loop triggered, by "
                                         "outcome (since the operator started)",
                                         labels=[*SERVICE_LABELS, "outcome"])
        for (namespace, name), status in sorted(snapshots.items()):
            labels = [namespace, name]
            families["spec_valid"].add_metric(labels, float(status is not None))
            if status is None:
                continue
            families["desired_instances"].add_metric(labels, status.desired)
            families["ready_instances"].add_metric(labels, status.ready)
            families["serving_instances"].add_metric(labels, status.serving)
            families["draining_instances"].add_metric(labels, sum(1 for i in status.instances if i.draining))
            if status.aggregate_freeness is not None and math.isfinite(status.aggregate_freeness):
                families["aggregate_freeness"].add_metric(labels, status.aggregate_freeness)
            counts = dict.fromkeys(MIGRATION_OUTCOMES, 0) | status.migrations
            for outcome, count in sorted(counts.items()):
                migrations.add_metric([*labels, outcome], count)
        yield from families.values()
        yield migrations


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(f"{PREFIX}_reconciles", "Create/update/resume handler runs, by result "
                                  "(changed, unchanged, invalid_spec, error)", ["result"], registry=r)
        self.reconcile_seconds = Histogram(f"{PREFIX}_reconcile_duration_seconds",
                                           "Time to ensure an LLMService's owned objects",
                                           buckets=_SECONDS_BUCKETS, registry=r)
        self.tick_seconds = Histogram(f"{PREFIX}_loop_tick_duration_seconds", "One daemon tick of an "
                                      "LLMService: spec, rolling update, replicas, status write",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "Failed reconciles and daemon ticks (retried)", ["stage"],
                              registry=r)
        self.scaling_events = Counter(f"{PREFIX}_scaling_events", "Control-loop actions that change an "
                                      "LLMService's instances, by direction (up, down, replace) and reason "
                                      "(the Kubernetes event's)", [*SERVICE_LABELS, "direction", "reason"],
                                      registry=r)
        # every result and stage at 0 from the start, so rate() shows the first of each
        for result in ("changed", "unchanged", "invalid_spec", "error"):
            self.reconciles.labels(result)
        for stage in ("reconcile", "tick"):
            self.errors.labels(stage)
        self._snapshots: dict[tuple[str, str], ServiceStatus | None] = {}
        self._lock = threading.Lock()
        r.register(_ServicesCollector(self._snapshots, self._lock))

    def publish(self, namespace: str, name: str, status: ServiceStatus | None) -> None:
        """The LLMService's latest status (None: its spec is invalid or not yet acted on)."""
        with self._lock:
            first = (namespace, name) not in self._snapshots
            self._snapshots[(namespace, name)] = status
        if first:  # every reason's series from the start, at 0, so rate() shows the first event
            for reason, direction in SCALING_DIRECTION.items():
                self.scaling_events.labels(namespace, name, direction, reason)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._snapshots.pop((namespace, name), None)

    def count_event(self, namespace: str, name: str, reason: str) -> None:
        direction = SCALING_DIRECTION.get(reason)
        if direction is not None:
            self.scaling_events.labels(namespace, name, direction, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


OPERATOR_METRICS = OperatorMetrics()
"""The operator process's metrics (kopf's handlers are process-wide too)."""
