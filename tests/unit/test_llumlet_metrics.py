"""The llumlet's load gauges as Prometheus scrapes them: no `instance` label, no infinities."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from llumlet.metrics import LlumletMetrics
from llumnix.load import InstanceLoad, freeness, virtual_usage
from llumnix.wire import LoadReport, LoadSource


def scrape(load: InstanceLoad, snapshot_age_s: float = 0.2) -> dict[str, dict[tuple, float]]:
    report = LoadReport(load, freeness(load), virtual_usage(load), snapshot_age_s, LoadSource.CONNECTOR)
    metrics = LlumletMetrics("engine-0", lambda: report)
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_load_gauges_are_labelled_instance_id_never_instance() -> None:
    samples = scrape(InstanceLoad("engine-0", total_blocks=100, free_blocks=60, block_size=16))
    assert samples["llumnix_llumlet_freeness"] == {(("instance_id", "engine-0"),): 60.0}
    assert samples["llumnix_llumlet_block_size_tokens"] == {(("instance_id", "engine-0"),): 16.0}
    for name, series in samples.items():
        for labels in series:
            assert "instance" not in dict(labels), name


def test_a_draining_instance_exports_no_infinity_and_says_it_drains() -> None:
    load = InstanceLoad("engine-0", total_blocks=100, free_blocks=60, draining=True)
    assert math.isinf(freeness(load))
    samples = scrape(load, snapshot_age_s=math.inf)
    assert "llumnix_llumlet_freeness" not in samples
    assert "llumnix_llumlet_virtual_usage_blocks" not in samples
    assert "llumnix_llumlet_snapshot_age_seconds" not in samples  # no snapshot yet: absent, not +Inf
    assert samples["llumnix_llumlet_draining"] == {(("instance_id", "engine-0"),): 1.0}
    assert all(math.isfinite(v) for series in samples.values() for v in series.values())
