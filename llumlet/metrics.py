"""The llumlet's Prometheus metrics (served on its HTTP port at /metrics)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llumlet.migration.downtime import DOWNTIME_PARTS
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.kv_transfer_pb2 import MigrationEvent
from llumnix.wire import LoadReport, LoadSource

PREFIX = "llumnix_llumlet"


class _LoadCollector(Collector):
    """Load gauges computed at scrape time from the newest report.

    The label is `instance_id`, never `instance`: Prometheus sets `instance` on every target itself
    (and renames a scraped one to `exported_instance`). No value is ever infinite: a draining
    instance's freeness and virtual usage (−inf / +inf in the load model) are left out, so `avg()` and
    `min()` over instances stay finite; `llumnix_llumlet_draining` says why they are missing."""

    def __init__(self, instance_id: str, current_report: Callable[[], LoadReport | None]) -> None:
        self._instance_id = instance_id
        self._current_report = current_report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        report = self._current_report()
        if report is None:
            return
        load = report.load
        values = {
            "freeness": ("Free KV blocks per batched request (x block size = decode steps of headroom); "
                         "absent while draining", report.freeness),
            "virtual_usage_blocks": ("Virtual usage in KV blocks; absent while draining",
                                     report.virtual_usage),
            "free_blocks": ("Free KV blocks reported by the engine", load.free_blocks),
            "total_blocks": ("Total KV blocks of the engine", load.total_blocks),
            "block_size_tokens": ("Tokens per KV block", load.block_size),
            "running_requests": ("Requests the engine is running", len(load.running)),
            "waiting_requests": ("Requests queued (engine queue and admitted-not-yet-queued)",
                                 len(load.waiting)),
            "recent_preemptions": ("Requests the engine preempted since its previous snapshot (non-zero: "
                                   "the instance is overloaded)", load.preemptions),
            "snapshot_age_seconds": ("Age of the engine observation behind the load; absent before the "
                                     "first", report.snapshot_age_s),
            "draining": ("1 while the instance is draining", float(load.draining)),
        }
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["instance_id"])
            if math.isfinite(value):
                family.add_metric([self._instance_id], float(value))
            yield family
        # one series per source (0 or 1), so a panel of the fallback has data while all is well
        source = GaugeMetricFamily(f"{PREFIX}_load_source", "1 for the source of the current load, 0 "
                                   "for the other", labels=["instance_id", "source"])
        for each in LoadSource:
            source.add_metric([self._instance_id, each.value], float(each is report.source))
        yield source


class _EngineStagingCollector(Collector):
    """What the engine's migration staging holds, as the engine last reported it (STAGING_HELD events
    on the engine channel); absent before its first report and once its reports stop."""

    def __init__(self, instance_id: str, staging_held: Callable[[], MigrationEvent | None]) -> None:
        self._instance_id = instance_id
        self._staging_held = staging_held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = self._staging_held()
        values = {
            "engine_staged_migrations": ("Migrations whose KV stages the engine holds in staging (not yet "
                                         "loaded, dropped or expired)", lambda h: h.migrations),
            "engine_staging_bytes": ("KV bytes the engine holds in staging for migrations in",
                                     lambda h: h.bytes),
        }
        for name, (doc, value_of) in values.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["instance_id"])
            if held is not None:
                family.add_metric([self._instance_id], float(value_of(held)))
            yield family


class LlumletMetrics:
    def __init__(self, instance_id: str, current_report: Callable[[], LoadReport | None],
                 engine_staging: Callable[[], MigrationEvent | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.admitted = Counter(f"{PREFIX}_admitted_requests", "Requests admitted",
                                registry=self.registry)
        self.finished = Counter(f"{PREFIX}_finished_requests", "Requests that left the llumlet",
                                ["outcome"], registry=self.registry)
        self.engine_ttft = Histogram(
            f"{PREFIX}_engine_first_chunk_seconds",
            "From admission to the engine's first streamed chunk (the engine's share of time to first token)",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
        self.refused = Counter(f"{PREFIX}_refused_requests",
                               "Requests refused (draining, shutting down or engine down)",
                               registry=self.registry)
        self.migrations = Counter(f"{PREFIX}_migrations", "Migrations this instance took part in",
                                  ["role", "outcome"], registry=self.registry)
        self.migration_stages = Counter(f"{PREFIX}_migration_stages", "KV stages sent by migrations out",
                                        registry=self.registry)
        self.migration_bytes = Counter(f"{PREFIX}_migration_bytes", "KV bytes sent by migrations out",
                                       registry=self.registry)
        self.migration_downtime = Histogram(
            f"{PREFIX}_migration_downtime_seconds",
            "Committed migrations out: from the final-stage abort to the destination's first token",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        self.migration_downtime_part = Histogram(
            f"{PREFIX}_migration_downtime_part_seconds",
            "Committed migrations out: the downtime's parts (llumlet.migration.downtime.DOWNTIME_PARTS)",
            ["part"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        self.migration_duration = Histogram(
            f"{PREFIX}_migration_duration_seconds", "Migrations out, from Propose to their end",
            ["outcome"], registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        # Every outcome's series exists from the start: one born at its first migration has no
        # increase for rate() to show, so an instance's first migration would be missing on dashboards.
        for outcome in mpb.MigrationOutcome.DESCRIPTOR.values:
            if outcome.number != mpb.MIGRATION_OUTCOME_UNSPECIFIED:
                self.migrations.labels("out", outcome.name)
                self.migration_duration.labels(outcome.name)
        for part in DOWNTIME_PARTS:
            self.migration_downtime_part.labels(part)
        self.registry.register(_LoadCollector(instance_id, current_report))
        self.registry.register(_EngineStagingCollector(instance_id, engine_staging))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
