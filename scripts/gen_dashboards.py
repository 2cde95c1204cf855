"""Writes the chart's Grafana dashboards (charts/llumnix/dashboards/*.json), built with
grafana-foundation-sdk from the panel lists below; a test fails when the checked-in JSON is stale,
and checks that every query parses, names only metrics the components export and carries the
namespace / LLMService filters.

Every dashboard has the variables `namespace` and `llmservice` (multi-select, All = `.*`), listed from
the operator's per-LLMService gauges, and every per-service series is filtered by them: router and
llumlet series by `namespace` (Prometheus Operator's target label: the pod's namespace) and
`llmservice` (the chart's PodMonitors copy it from the pod label llumnix.io/service), the operator's
per-service series by their own labels `llmservice_namespace` and `llmservice`. The operator's own
reconcile and tick series belong to no LLMService and stay unfiltered.

    .venv/bin/python scripts/gen_dashboards.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS_DIR = ROOT / "charts/llumnix/dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"

POD_FILTER = ('namespace=~"$namespace"', 'llmservice=~"$llmservice"')
"""Router and llumlet series: `namespace` is the pod's (Prometheus Operator's target label),
`llmservice` the pod label llumnix.io/service (the chart's PodMonitors relabel it)."""
OPERATOR_FILTER = ('llmservice_namespace=~"$namespace"', 'llmservice=~"$llmservice"')
"""The operator's per-LLMService series label the service themselves (its pod's `namespace` is the
operator's)."""
OPERATOR_WIDE = frozenset({"llumnix_operator_reconciles_total", "llumnix_operator_errors_total",
                           "llumnix_operator_reconcile_duration_seconds",
                           "llumnix_operator_loop_tick_duration_seconds"})
"""Operator series of no LLMService: no filter."""
VARIABLE_METRIC = "llumnix_operator_spec_valid"
"""Lists every LLMService the operator acts on (valid spec or not): the variables' values."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


def s(metric: str, *matchers: str) -> str:
    """The series selector of a metric, with its own matchers and the dashboard's filters."""
    if metric.startswith("llumnix_operator_"):
        filters = () if metric.removesuffix("_bucket") in OPERATOR_WIDE else OPERATOR_FILTER
    else:
        filters = POD_FILTER
    return f"{metric}{{{', '.join((*matchers, *filters))}}}" if matchers or filters else metric


def quantiles(metric: str) -> tuple[Query, ...]:
    """p50 and p99 of a histogram, summed over every process of the selected services."""
    buckets = s(f"{metric}_bucket")
    return tuple(
        q(f"histogram_quantile({p}, sum by (le) (rate({buckets}[{RATE}])))", f"p{round(p * 100)}")
        for p in (0.5, 0.99)
    )


NOT_DRAINING = f"unless on (namespace, instance_id) ({s('llumnix_llumlet_draining')} == 1)"
OPERATOR_WIDE_NOTE = "The operator's own series: not filtered by namespace / LLMService"
SERVICE_LEGEND = "{{llmservice_namespace}}/{{llmservice}}"
MIGRATIONS_OUT = s("llumnix_llumlet_migrations_total", 'role="out"')

DASHBOARDS: dict[str, tuple[str, dict[str, list[PanelSpec]]]] = {
    "service": ("Llumnix / Service", {
        "Requests": [
            PanelSpec("Requests by status", "reqps", (
                q(f"sum by (status) (rate({s('llumnix_router_requests_total')}[{RATE}]))", "{{status}}"),),
                "Finished requests per second by HTTP status (499: the client went away)"),
            PanelSpec("Time to first token", "s", quantiles("llumnix_router_time_to_first_token_seconds")),
            PanelSpec("Time per output token", "s",
                      quantiles("llumnix_router_time_per_output_token_seconds")),
            PanelSpec("End-to-end latency", "s", quantiles("llumnix_router_e2e_latency_seconds")),
            PanelSpec("Queued and in flight", "short", (
                q(f"sum({s('llumnix_router_queue_length')})", "queued (every instance busy)"),
                q(f"sum({s('llumnix_router_in_flight_requests')})", "in flight"))),
            PanelSpec("Retries, replays, moves followed", "ops", (
                q(f"sum(rate({s('llumnix_router_retries_total')}[{RATE}]))", "retries"),
                q(f"sum(rate({s('llumnix_router_replays_total')}[{RATE}]))", "replays"),
                q(f"sum(rate({s('llumnix_router_moves_followed_total')}[{RATE}]))", "moves followed"))),
        ],
        "Capacity": [
            PanelSpec("Instances ready / desired", "short", tuple(
                q(f"sum by (llmservice_namespace, llmservice) ({s(f'llumnix_operator_{kind}_instances')})",
                  f"{kind} {SERVICE_LEGEND}")
                for kind in ("desired", "ready", "serving"))),
            PanelSpec("Aggregate freeness (the autoscaler's signal)", "short", (
                q(f"max by (llmservice_namespace, llmservice) ({s('llumnix_operator_aggregate_freeness')})",
                  SERVICE_LEGEND),),
                "Free KV blocks per batched request, all serving instances as one; scale-up below "
                "spec.autoscaling.scaleUpBelow, scale-down above scaleDownAbove"),
            PanelSpec("Scale events", "short", (
                q(f"sum by (llmservice_namespace, llmservice, direction, reason) "
                  f"(increase({s('llumnix_operator_scaling_events_total')}[{RATE}]))",
                  f"{SERVICE_LEGEND} {{{{direction}}}} {{{{reason}}}}"),),
                "Control-loop actions on the instance set, by direction and the Kubernetes event's reason"),
        ],
    }),
    "instances": ("Llumnix / Instances", {
        "Load": [
            PanelSpec("Freeness per instance (draining ones excluded)", "short", (
                q(f"{s('llumnix_llumlet_freeness')} {NOT_DRAINING}", "{{instance_id}}"),),
                "Free KV blocks per batched request; x block size = decode steps of headroom"),
            PanelSpec("Virtual usage per instance (draining ones excluded)", "short", (
                q(f"{s('llumnix_llumlet_virtual_usage_blocks')} {NOT_DRAINING}", "{{instance_id}}"),)),
            PanelSpec("Free / total KV blocks", "short", (
                q(s("llumnix_llumlet_free_blocks"), "free {{instance_id}}"),
                q(s("llumnix_llumlet_total_blocks"), "total {{instance_id}}"))),
            PanelSpec("Running / waiting requests", "short", (
                q(s("llumnix_llumlet_running_requests"), "running {{instance_id}}"),
                q(s("llumnix_llumlet_waiting_requests"), "waiting {{instance_id}}"))),
        ],
        "Health": [
            PanelSpec("Preemptions (since the previous snapshot)", "short", (
                q(s("llumnix_llumlet_recent_preemptions"), "{{instance_id}}"),)),
            PanelSpec("Snapshot age", "s", (q(s("llumnix_llumlet_snapshot_age_seconds"), "{{instance_id}}"),),
                      "Age of the engine observation behind the load (grows while idle: the engine "
                      "publishes on steps)"),
            PanelSpec("Draining and load source", "short", (
                q(s("llumnix_llumlet_draining"), "draining {{instance_id}}"),
                q(s("llumnix_llumlet_load_source", 'source="metrics-fallback"'),
                  "metrics fallback {{instance_id}}"))),
        ],
    }),
    "migrations": ("Llumnix / Migrations", {
        "Migrations": [
            PanelSpec("Migrations out by outcome", "ops", (
                q(f"sum by (outcome) (rate({MIGRATIONS_OUT}[{RATE}]))", "{{outcome}}"),)),
            PanelSpec("Triggered by the control loop, by outcome", "ops", (
                q(f"sum by (outcome) (rate({s('llumnix_operator_migrations_total')}[{RATE}]))",
                  "{{outcome}}"),)),
            PanelSpec("Downtime (committed)", "s", quantiles("llumnix_llumlet_migration_downtime_seconds"),
                      "Final-stage abort on the source to the destination's first token"),
            PanelSpec("Downtime by part (p99)", "s", (
                q("histogram_quantile(0.99, sum by (part, le) (rate("
                  f"{s('llumnix_llumlet_migration_downtime_part_seconds_bucket')}[{RATE}])))", "{{part}}"),),
                "Where the downtime goes: source_stop (the abort into the source engine and the step it "
                "waits for), source_kv (the last blocks' copy and send), source_event, commit_transit, "
                "destination (Commit received to its first token)"),
            PanelSpec("Duration", "s", quantiles("llumnix_llumlet_migration_duration_seconds")),
            PanelSpec("KV bytes sent", "Bps", (
                q(f"sum(rate({s('llumnix_llumlet_migration_bytes_total')}[{RATE}]))", "bytes/s"),)),
            PanelSpec("KV stages sent", "ops", (
                q(f"sum(rate({s('llumnix_llumlet_migration_stages_total')}[{RATE}]))", "stages/s"),)),
        ],
    }),
    "operator": ("Llumnix / Operator", {
        "Operator": [
            PanelSpec("Reconciles by result", "ops", (
                q(f"sum by (result) (rate({s('llumnix_operator_reconciles_total')}[{RATE}]))",
                  "{{result}}"),),
                OPERATOR_WIDE_NOTE),
            PanelSpec("Errors by stage", "ops", (
                q(f"sum by (stage) (rate({s('llumnix_operator_errors_total')}[{RATE}]))", "{{stage}}"),),
                OPERATOR_WIDE_NOTE),
            PanelSpec("Reconcile duration", "s", quantiles("llumnix_operator_reconcile_duration_seconds"),
                      OPERATOR_WIDE_NOTE),
            PanelSpec("Daemon tick latency", "s", quantiles("llumnix_operator_loop_tick_duration_seconds"),
                      OPERATOR_WIDE_NOTE),
            PanelSpec("Desired vs ready per LLMService", "short", (
                q(s("llumnix_operator_desired_instances"), f"desired {SERVICE_LEGEND}"),
                q(s("llumnix_operator_ready_instances"), f"ready {SERVICE_LEGEND}"))),
            PanelSpec("Spec valid", "short", (q(s("llumnix_operator_spec_valid"), SERVICE_LEGEND),)),
        ],
    }),
}


def service_variable(name: str, label: str, query: str) -> QueryVariable:
    """A multi-select of the label's values on the operator's per-LLMService gauge; All is `.*`, which
    also keeps series without the label (a `llumnix up` service scraped outside Kubernetes)."""
    return (QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text=["All"], value=["$__all"])))


VARIABLES = (
    service_variable("namespace", "Namespace", f"label_values({VARIABLE_METRIC}, llmservice_namespace)"),
    service_variable("llmservice", "LLMService",
                     f'label_values({VARIABLE_METRIC}{{llmservice_namespace=~"$namespace"}}, llmservice)'),
)


def build(title: str, uid: str, rows: dict[str, list[PanelSpec]]) -> Dashboard:
    dashboard = (
        Dashboard(title)
        .uid(f"llumnix-{uid}")
        .tags(["llumnix"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for variable in VARIABLES:
        dashboard = dashboard.with_variable(variable)
    panel_id = 0
    for row, panels in rows.items():
        panel_id += 1
        dashboard = dashboard.with_row(Row(row).id(panel_id))
        for panel in panels:
            panel_id += 1
            timeseries = (Timeseries().id(panel_id).title(panel.title).unit(panel.unit)
                          .datasource(DATASOURCE).span(8))
            if panel.description:
                timeseries = timeseries.description(panel.description)
            for ref, query in zip("ABCDEFGH", panel.queries, strict=False):
                timeseries = timeseries.with_target(
                    Dataquery().ref_id(ref).expr(query.expr).legend_format(query.legend).datasource(DATASOURCE))
            dashboard = dashboard.with_panel(timeseries)
    return dashboard


def render() -> dict[str, str]:
    """File name -> JSON text of each dashboard."""
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {f"{uid}.json": encoder.encode(build(title, uid, rows).build()) + "\n"
            for uid, (title, rows) in DASHBOARDS.items()}


if __name__ == "__main__":
    DASHBOARDS_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (DASHBOARDS_DIR / name).write_text(text)
    print(f"wrote {len(DASHBOARDS)} dashboards to {DASHBOARDS_DIR}", file=sys.stderr)
