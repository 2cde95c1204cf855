"""Evaluates every panel query of the chart's Grafana dashboards (charts/llumnix/dashboards/*.json)
through a Prometheus server's HTTP API and draws each dashboard as a PNG grid of its panels, with
their titles, units and legends: Grafana is not in Debian, Prometheus and matplotlib are.

    .venv/bin/python scripts/render_dashboards.py --prometheus http://127.0.0.1:9090 \\
        --start 1764660000 --end 1764660120 --out docs/figures/dashboards

The dashboards' variables `namespace` and `llmservice` are All (`.*`) unless --namespace /
--llmservice name one value each (as Grafana does with one selected value: the value, regex-escaped).

tests/integration/test_monitoring_live.py uses the same evaluation to check that every panel has
data in a real run, and draws docs/figures/dashboards/*.png from that run when
LLUMNIX_DASHBOARD_FIGURES names a folder (see docs/observability.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS_DIR = ROOT / "charts/llumnix/dashboards"
ALL = ".*"  # the variables' All value (allValue in the dashboards)
VARIABLES = {"namespace": ALL, "llmservice": ALL}
UNITS = {"reqps": "requests/s", "ops": "per second", "s": "seconds", "Bps": "bytes/s", "short": ""}


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    dashboard: str
    title: str
    unit: str
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Series:
    legend: str
    points: tuple[tuple[float, float], ...]  # (unix time, value); NaN where PromQL says so

    @property
    def has_value(self) -> bool:
        return any(math.isfinite(v) for _, v in self.points)

    @property
    def has_nonzero(self) -> bool:
        return any(math.isfinite(v) and v != 0 for _, v in self.points)


def dashboards(folder: Path = DASHBOARDS_DIR) -> dict[str, tuple[str, list[Panel]]]:
    """{file stem: (title, panels)} of every dashboard JSON, in file order."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        board = json.loads(path.read_text())
        panels = [
            Panel(path.stem, p["title"], p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
                  tuple(Target(t["expr"], t.get("legendFormat", "")) for t in p["targets"]))
            for p in board["panels"] if p.get("targets")
        ]
        found[path.stem] = (board["title"], panels)
    return found


def selecting(namespace: str | None = None, llmservice: str | None = None) -> dict[str, str]:
    """The dashboards' variables as Grafana puts them in a query: All is `.*`, one selected value is
    the value with its regex metacharacters escaped (the backslash doubled inside a PromQL string)."""
    def one(value: str | None) -> str:
        return ALL if value is None else re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)

    return {"namespace": one(namespace), "llmservice": one(llmservice)}


def grafana_to_promql(expr: str, scrape_interval_s: float, variables: dict[str, str] | None = None) -> str:
    """Substitutes what Grafana would: $__rate_interval is max(step + scrape interval, 4 scrape
    intervals) at a step of one scrape interval; $namespace and $llmservice are the variables' values
    (default All: `.*`)."""
    values = VARIABLES | (variables or {})
    values["__rate_interval"] = f"{round(4 * scrape_interval_s * 1000)}ms"
    reference = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
    unknown = {m.group(1) or m.group(2) for m in reference.finditer(expr)} - set(values)
    if unknown:
        raise ValueError(f"{expr}: no value for {sorted(unknown)}")
    return reference.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def legend(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text.strip() or json.dumps(labels, sort_keys=True)


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as response:
        answer = json.loads(response.read())
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    return answer["data"]["result"]


def evaluate(prometheus: str, panel: Panel, start: float, end: float, scrape_interval_s: float,
             variables: dict[str, str] | None = None) -> list[Series]:
    """Every series each of the panel's queries returns over [start, end], as Grafana would draw it
    with those variables (default: All)."""
    series = []
    for target in panel.targets:
        expr = grafana_to_promql(target.expr, scrape_interval_s, variables)
        for result in query_range(prometheus, expr, start, end, scrape_interval_s):
            points = tuple((float(t), float(v)) for t, v in result["values"])
            series.append(Series(legend(target.legend, result["metric"]), points))
    return series


def draw(title: str, panels: list[tuple[Panel, list[Series]]], path: Path, start: float,
         end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3 if len(panels) > 4 else 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels, strict=False):
        if any(one.has_nonzero for one in series):  # as Grafana's legend option "hide zeros"
            series = [one for one in series if one.has_nonzero]
        for one in sorted(series, key=lambda s: s.legend):
            ax.plot([t - start for t, _ in one.points], [v for _, v in one.points], label=one.legend,
                    linewidth=1.4)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.set_ylabel(UNITS.get(panel.unit, panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, end - start)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="best", ncol=2 if len(series) > 6 else 1)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    figure.suptitle(title, fontsize=13)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def render(prometheus: str, start: float, end: float, out: Path, scrape_interval_s: float,
           variables: dict[str, str] | None = None) -> list[Path]:
    written = []
    for stem, (title, panels) in dashboards().items():
        data = [(panel, evaluate(prometheus, panel, start, end, scrape_interval_s, variables))
                for panel in panels]
        draw(title, data, out / f"{stem}.png", start, end)
        written.append(out / f"{stem}.png")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--start", type=float, required=True, help="unix time")
    parser.add_argument("--end", type=float, required=True, help="unix time")
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="seconds (the query step)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/figures/dashboards")
    parser.add_argument("--namespace", help="the LLMServices' namespace (default: All)")
    parser.add_argument("--llmservice", help="one LLMService (default: All)")
    args = parser.parse_args()
    variables = selecting(args.namespace, args.llmservice)
    for path in render(args.prometheus, args.start, args.end, args.out, args.scrape_interval, variables):
        print(path)


if __name__ == "__main__":
    main()
