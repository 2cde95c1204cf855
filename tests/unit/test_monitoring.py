"""The chart's dashboards and alerts: generated JSON is current, every query parses (promql-parser)
and names only metrics the router, the llumlet and the operator export, every alert has a runbook,
promtool accepts and unit-tests the rules, and the chart renders the monitoring objects."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from script_module import load_script

from llumlet.metrics import LlumletMetrics
from llumnix.control.status import InstanceStatus, ServiceStatus
from llumnix.load import InstanceLoad
from llumnix.router.metrics import RouterMetrics
from llumnix.wire import LoadReport, LoadSource
from llumnix_operator.metrics import OperatorMetrics

promql = pytest.importorskip("promql_parser", reason="promql-parser is not installed (dev extra)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/llumnix"
RULES = CHART / "alerts/llumnix-alerts.yaml"
RULE_TESTS = ROOT / "tests/monitoring/llumnix-alerts.test.yaml"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",)}


def series_names(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def exported_metrics() -> set[str]:
    """Every series name the three components can export (families are listed even before their
    first sample)."""
    load = InstanceLoad("engine-0", total_blocks=100, free_blocks=60)
    llumlet = LlumletMetrics("engine-0", lambda: LoadReport(load, 60.0, 40.0, 0.1, LoadSource.CONNECTOR))
    operator = OperatorMetrics()
    operator.publish("ns", "svc", ServiceStatus("svc", 1, (InstanceStatus("svc-0", "ready", "a:1", 5.0),),
                                                aggregate_freeness=5.0))
    return (series_names(llumlet.registry) | series_names(RouterMetrics().registry)
            | series_names(operator.registry))


def names_in(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql.VectorSelector):
            names.add(node.name)

    promql.walk(promql.parse(expr.replace("$__rate_interval", "1m")), visit)
    return names


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every target in the checked-in dashboards."""
    queries = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            queries += [(path.stem, panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return queries


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_checked_in_dashboards_are_current() -> None:
    rendered = load_script("gen_dashboards").render()
    on_disk = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert on_disk == rendered, "run: .venv/bin/python scripts/gen_dashboards.py"
    assert set(rendered) == {"service.json", "instances.json", "migrations.json", "operator.json"}


def test_every_dashboard_query_parses_and_names_exported_metrics() -> None:
    exported = exported_metrics()
    queries = dashboard_queries()
    assert len(queries) > 30
    for dashboard, title, expr in queries:
        names = names_in(expr)
        assert names, (dashboard, title, expr)
        assert names <= exported, f"{dashboard} / {title}: unknown {sorted(names - exported)}"
        assert not re.search(r"[{,]\s*instance\s*[=!~]|by \(instance\)", expr), "instance is Prometheus's"


def test_every_alert_parses_names_exported_metrics_and_has_a_runbook() -> None:
    exported = exported_metrics()
    runbooks = (ROOT / "docs/observability.md").read_text()
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "LlumnixNoReadyInstance", "LlumnixHigh5xxRatio", "LlumnixHighTTFTP99", "LlumnixQueueBuildUp",
        "LlumnixMigrationFailureRatio", "LlumnixStaleSnapshots", "LlumnixDesiredNotReady",
        "LlumnixOperatorDown"}
    for rule in rules:
        names = names_in(rule["expr"])
        assert names and names <= exported, f"{rule['alert']}: unknown {sorted(names - exported)}"
        assert f"\n### {rule['alert']}\n" in runbooks, f"no runbook section for {rule['alert']}"
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert anchor == rule["alert"].lower()


promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not found: scripts/setup.sh installs Debian's prometheus package "
    "where apt-get can run as root (see docs/observability.md)")


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_the_alerts() -> None:
    result = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_llumlet_series_that_dashboards_rate_exist_before_their_first_event() -> None:
    """A counter series born at its first event has no increase for rate() to show, so a Prometheus
    dashboard would miss an instance's first migration of each outcome; and a load-source series that
    exists only during a fallback leaves its panel empty while all is well."""
    load = InstanceLoad("engine-0", total_blocks=100, free_blocks=60)
    metrics = LlumletMetrics("engine-0", lambda: LoadReport(load, 60.0, 40.0, 0.1, LoadSource.CONNECTOR))
    registry = metrics.registry
    for outcome in ("MIGRATION_OUTCOME_COMMITTED", "MIGRATION_OUTCOME_ABORTED", "MIGRATION_OUTCOME_REFUSED"):
        assert registry.get_sample_value("llumnix_llumlet_migrations_total",
                                          {"role": "out", "outcome": outcome}) == 0
        assert registry.get_sample_value("llumnix_llumlet_migration_duration_seconds_count",
                                          {"outcome": outcome}) == 0
    sources = {source: registry.get_sample_value("llumnix_llumlet_load_source",
                                                 {"instance_id": "engine-0", "source": source})
               for source in ("connector", "metrics-fallback")}
    assert sources == {"connector": 1.0, "metrics-fallback": 0.0}


def test_render_dashboards_reads_every_panel_query_and_draws_a_grid(tmp_path: Path) -> None:
    """scripts/render_dashboards.py (the pictures in docs/observability.md) evaluates exactly the
    checked-in dashboards' queries, substitutes what Grafana would, and names series as the legends do."""
    render = load_script("render_dashboards")
    boards = render.dashboards()
    targets = [(stem, panel.title, target.expr)
               for stem, (_, panels) in boards.items() for panel in panels for target in panel.targets]
    assert targets == dashboard_queries()
    assert render.grafana_to_promql("rate(x[$__rate_interval])", 1.0) == "rate(x[4000ms])"
    labels = {"llmservice": "llama", "direction": "up"}
    assert render.legend("{{llmservice}} {{direction}}", labels) == "llama up"
    title, panels = boards["migrations"]
    data = [(panel, [render.Series("p50", ((0.0, 0.1), (1.0, 0.2)))]) for panel in panels]
    render.draw(title, data, tmp_path / "migrations.png", 0.0, 1.0)
    assert (tmp_path / "migrations.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
