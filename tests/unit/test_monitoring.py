"""The chart's dashboards and alerts: generated JSON is current, every query parses (promql-parser)
and names only metrics the router, the llumlet and the operator export, every series a dashboard
selects is filtered by its namespace / LLMService variables under the labels that series carries once
scraped, every alert has a runbook, promtool accepts and unit-tests the rules, and the chart renders
the monitoring objects."""

from __future__ import annotations

import json
import re
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
from llumnix_operator.metrics import SERVICE_LABELS, OperatorMetrics
from llumnix_operator.naming import ENGINE, ROUTER, SERVICE_LABEL, labels

promql = pytest.importorskip("promql_parser", reason="promql-parser is not installed (dev extra)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/llumnix"
RULES = CHART / "alerts/llumnix-alerts.yaml"
RULE_TESTS = ROOT / "tests/monitoring/llumnix-alerts.test.yaml"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",)}


def series_names(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def registries() -> tuple[CollectorRegistry, CollectorRegistry, CollectorRegistry]:
    """The llumlet's, the router's and the operator's (with one LLMService published)."""
    load = InstanceLoad("engine-0", total_blocks=100, free_blocks=60)
    llumlet = LlumletMetrics("engine-0", lambda: LoadReport(load, 60.0, 40.0, 0.1, LoadSource.CONNECTOR))
    operator = OperatorMetrics()
    operator.publish("ns", "svc", ServiceStatus("svc", 1, (InstanceStatus("svc-0", "ready", "a:1", 5.0),),
                                                aggregate_freeness=5.0))
    return llumlet.registry, RouterMetrics().registry, operator.registry


def exported_metrics() -> set[str]:
    """Every series name the three components can export (families are listed even before their
    first sample)."""
    return set().union(*(series_names(registry) for registry in registries()))


POD_FILTER = {"namespace": "$namespace", "llmservice": "$llmservice"}
"""Router and llumlet series once the chart's PodMonitors scraped them: `namespace` is Prometheus
Operator's target label, `llmservice` the pods' llumnix.io/service label (the monitors relabel it)."""
OPERATOR_FILTER = {"llmservice_namespace": "$namespace", "llmservice": "$llmservice"}
"""The operator's per-LLMService series label the service themselves."""


def expected_filters() -> dict[str, dict[str, str]]:
    """Series name -> the regex matchers a dashboard must put on it: the pods' filter on everything
    the router and the llumlet export, the operator's on its series that carry SERVICE_LABELS, none on
    the operator's own (reconciles, ticks)."""
    llumlet, router, operator = registries()
    filters = dict.fromkeys(series_names(llumlet) | series_names(router), POD_FILTER)
    for family in operator.collect():
        for suffix in SUFFIXES[family.type]:
            per_service = set(SERVICE_LABELS) <= set(family.samples[0].labels) if family.samples else False
            filters[family.name + suffix] = OPERATOR_FILTER if per_service else {}
    return filters


def selectors_in(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: regex}) of every series selector, its `=~` matchers only."""
    found: list[tuple[str, dict[str, str]]] = []

    def visit(node: object) -> None:
        if isinstance(node, promql.VectorSelector):
            found.append((node.name, {m.name: m.value for m in node.matchers.matchers
                                      if m.op == promql.MatchOp.Re}))

    promql.walk(promql.parse(expr.replace("$__rate_interval", "1m")), visit)
    return found


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


def dashboard_variables() -> dict[str, list[dict]]:
    return {path.stem: json.loads(path.read_text())["templating"]["list"]
            for path in sorted((CHART / "dashboards").glob("*.json"))}


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


def test_every_dashboard_selects_by_namespace_and_llmservice() -> None:
    """Multi-select query variables with All = `.*` (which keeps series without the labels: a `llumnix
    up` service scraped outside Kubernetes), listed from the operator's per-LLMService series, the
    LLMService list narrowed to the namespaces selected."""
    per_service = {name for name, f in expected_filters().items() if f == OPERATOR_FILTER}
    for dashboard, variables in dashboard_variables().items():
        assert [v["name"] for v in variables] == ["datasource", "namespace", "llmservice"], dashboard
        for variable in variables[1:]:
            assert variable["type"] == "query"
            assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
            assert variable["current"]["value"] == ["$__all"]
            assert variable["datasource"]["uid"] == "${datasource}"
            assert variable["refresh"] == 2  # on time range change: services come and go
        namespaces, services = (v["query"] for v in variables[1:])
        match = re.fullmatch(r"label_values\((\w+), llmservice_namespace\)", namespaces)
        assert match and match.group(1) in per_service, namespaces
        match = re.fullmatch(r'label_values\((\w+)\{llmservice_namespace=~"\$namespace"\}, llmservice\)',
                             services)
        assert match and match.group(1) in per_service, services


def test_every_dashboard_series_is_filtered_by_the_labels_it_carries() -> None:
    filters = expected_filters()
    assert {name for name, f in filters.items() if not f} == {
        f"llumnix_operator_{name}" for name in (
            "reconciles_total", "reconciles_created", "errors_total", "errors_created",
            *(f"{h}_seconds{s}" for h in ("reconcile_duration", "loop_tick_duration")
              for s in ("_bucket", "_count", "_sum", "_created")))}
    for dashboard, title, expr in dashboard_queries():
        for name, matchers in selectors_in(expr):
            assert matchers == filters[name], f"{dashboard} / {title}: {name} {matchers} in {expr}"


def test_the_chart_attaches_the_labels_the_dashboards_filter_router_and_llumlet_series_by() -> None:
    """The routers' and engines' PodMonitors turn the pod label that names the LLMService (set by the
    operator on both) into `llmservice`; Prometheus Operator adds `namespace` to every target itself."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (dev extra)")
    assert labels("svc", ROUTER)[SERVICE_LABEL] == labels("svc", ENGINE)[SERVICE_LABEL] == "svc"
    chart = helm.Chart.load(str(CHART))
    try:
        rendered = chart.render({"monitoring": {"enabled": True}}, name="rel", namespace="llumnix")
    finally:
        chart.close()
    monitors = {doc["metadata"]["name"]: doc for path, text in rendered.items() if not path.endswith(".txt")
                for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "PodMonitor"}
    source = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", SERVICE_LABEL)
    for name in ("rel-llumnix-operator-routers", "rel-llumnix-operator-engines"):
        (endpoint,) = monitors[name]["spec"]["podMetricsEndpoints"]
        assert {"sourceLabels": [source], "targetLabel": "llmservice"} in endpoint["relabelings"], name


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


def test_the_promtool_tests_fire_every_alert() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {check["alertname"] for test in tests for check in test["alert_rule_test"] if check["exp_alerts"]}
    assert fired == {rule["alert"] for rule in alert_rules()}


def test_promtool_checks_the_rules(promtool_path: str) -> None:
    result = subprocess.run([promtool_path, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_the_alerts(promtool_path: str) -> None:
    result = subprocess.run([promtool_path, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
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
    selector = 'x{namespace=~"$namespace", llmservice=~"$llmservice"}'
    assert render.grafana_to_promql(selector, 1.0) == 'x{namespace=~".*", llmservice=~".*"}'
    one = render.grafana_to_promql(selector, 1.0, render.selecting("prod", "llama.v2"))
    assert one == 'x{namespace=~"prod", llmservice=~"llama\\\\.v2"}'  # as Grafana escapes one value
    assert promql.parse(one)
    with pytest.raises(ValueError, match="cluster"):
        render.grafana_to_promql('x{cluster=~"$cluster"}', 1.0)
    labels = {"llmservice": "llama", "direction": "up"}
    assert render.legend("{{llmservice}} {{direction}}", labels) == "llama up"
    title, panels = boards["migrations"]
    data = [(panel, [render.Series("p50", ((0.0, 0.1), (1.0, 0.2)))]) for panel in panels]
    render.draw(title, data, tmp_path / "migrations.png", 0.0, 1.0)
    assert (tmp_path / "migrations.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
