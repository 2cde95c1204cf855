"""Proof with real parts: Debian's `prometheus` server scrapes the cluster-in-a-test (the operator,
the router it deploys and every engine pod's llumlet, each pod a real sim engine + llumlet) once a
second while a load spike scales the service up and its fall drains a pod by live migration; then
every query of every dashboard panel, evaluated by that Prometheus over the run through its HTTP API
(/api/v1/query_range, as Grafana does), returns data.

With LLUMNIX_DASHBOARD_FIGURES=<folder> the run also draws each dashboard from that data
(scripts/render_dashboards.py), which is how docs/figures/dashboards/*.png are made."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
from kube_emulator import EmulatedCluster
from kubelet_emulator import Kubelet
from test_operator_cluster import Load, _healthy, cluster, operator_and_kubelet, wait_for  # noqa: F401

from llumnix_operator.http_endpoint import OperatorEndpoint
from llumnix_operator.metrics import OPERATOR_METRICS
from llumnix_operator.naming import LLUMLET_HTTP_PORT

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not found: scripts/setup.sh installs Debian's "
                       "prometheus package where apt-get can run as root (see docs/observability.md)"),
]
ROOT = Path(__file__).resolve().parents[2]
G, V, P, NS = "llumnix.io", "v1alpha1", "llmservices", "default"
SCRAPE_INTERVAL_S = 1.0
ROUTER_PORT = 8000
NO_DATA_IN_A_GOOD_RUN = {
    ("operator", "Errors by stage"):
        "llumnix_operator_errors_total is labelled by the failing stage: it has series only after a "
        "failed reconcile or tick, and none fails here",
}
"""Panels that cannot have data in this run, with the reason; every other panel must."""


def load_render_dashboards():
    spec = importlib.util.spec_from_file_location("render_dashboards", ROOT / "scripts/render_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_dashboards"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Debian's prometheus server with one job per component, each fed by a file_sd target file the
    test rewrites as pods come and go."""

    JOBS = ("router", "llumlet", "operator")

    def __init__(self, work: Path) -> None:
        self.work = work
        self.url = f"http://127.0.0.1:{free_port()}"
        self._process: subprocess.Popen | None = None

    def set_targets(self, job: str, addresses: list[str]) -> None:
        path = self.work / f"{job}.json"
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps([{"targets": sorted(addresses)}]))
        staged.replace(path)  # atomic: prometheus never reads half a file

    def query(self, expr: str) -> list[dict]:
        params = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=10) as response:
            return json.loads(response.read())["data"]["result"]

    def __enter__(self) -> Prometheus:
        for job in self.JOBS:
            self.set_targets(job, [])
        interval = f"{round(SCRAPE_INTERVAL_S * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "file_sd_configs": [{"files": [str(self.work / f"{job}.json")],
                                                        "refresh_interval": interval}]}
                for job in self.JOBS
            ],
        }
        (self.work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self._process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.work / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.work / 'data'}", f"--web.listen-address={self.url[7:]}",
             "--log.level=warn"],
            stdout=(self.work / "prometheus.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(self._ready, 60, "prometheus /-/ready")
        return self

    def _ready(self) -> bool:
        assert self._process.poll() is None, (self.work / "prometheus.log").read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


class TargetFeeder:
    """Keeps the target files current: the router, every engine pod's llumlet, the operator."""

    def __init__(self, prometheus: Prometheus, kubelet: Kubelet, operator_port: int) -> None:
        self.prometheus = prometheus
        self.kubelet = kubelet
        prometheus.set_targets("operator", [f"127.0.0.1:{operator_port}"])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            routers = [f"{pod.ip}:{ROUTER_PORT}" for pod in list(self.kubelet.routers.values())]
            llumlets = [f"{pod.ip}:{LLUMLET_HTTP_PORT}" for pod in list(self.kubelet.pods.values())]
            self.prometheus.set_targets("router", routers)
            self.prometheus.set_targets("llumlet", llumlets)

    def __enter__(self) -> TargetFeeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    work = tmp_path / "prometheus"
    work.mkdir()
    with Prometheus(work) as server:
        yield server


@pytest.fixture
def operator_endpoint() -> Iterator[OperatorEndpoint]:
    """The operator's /metrics, as `llumnix operator --metrics-port` serves it, for the kopf run."""
    ready = threading.Event()
    ready.set()
    endpoint = OperatorEndpoint("127.0.0.1", 0, OPERATOR_METRICS, ready)
    endpoint.start()
    yield endpoint
    endpoint.stop()


def test_every_dashboard_panel_has_data_in_prometheus(
    cluster: EmulatedCluster, prometheus: Prometheus, operator_endpoint: OperatorEndpoint  # noqa: F811
) -> None:
    render = load_render_dashboards()
    custom = kubernetes.client.CustomObjectsApi(
        kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)))

    def ready() -> int:
        live = cluster.emulator.live("llmservices").get("live", {})
        return ((live.get("status") or {}).get("instances") or {}).get("ready", 0)

    def engine_pods() -> set[str]:
        return {n for n in cluster.emulator.live("pods") if n.startswith("live-engine-")}

    def in_prometheus(expr: str) -> bool:
        return bool(prometheus.query(expr))

    start = time.time()
    with operator_and_kubelet(cluster) as (kubelet, runner), \
            TargetFeeder(prometheus, kubelet, operator_endpoint.port):
        custom.create_namespaced_custom_object(G, V, NS, P, {
            "apiVersion": f"{G}/{V}", "kind": "LLMService", "metadata": {"name": "live"},
            "spec": {
                "model": {"name": "sim"},
                "instances": {"min": 1, "max": 3},
                # 64 blocks of 16 tokens: eight 139-token requests overfill one instance
                "engine": {"runtime": "sim", "resources": {"gpus": 0}, "args": ["--num-blocks", "64"]},
                "migration": {"intervalMs": 200},
                "autoscaling": {"enabled": True, "scaleUpBelow": 10, "scaleDownAbove": 40,
                                "intervalSeconds": 1, "scaleDownStabilizationSeconds": 3,
                                "startupGraceSeconds": 120},
            },
        })
        wait_for(lambda: ready() == 1, 120, "the first instance")
        wait_for(lambda: "live-router" in kubelet.routers, 30, "the router")
        url = kubelet.router_url("live-router", ROUTER_PORT)
        wait_for(lambda: _healthy(url), 60, "the router's /health")

        with Load(url, clients=8) as spike:  # a scale-up
            wait_for(lambda: ready() >= 2 and len(engine_pods()) >= 2, 180, "a scale-up by the autoscaler")
            wait_for(lambda: spike.ok >= 10, 120, "requests served after the scale-up")
        peak = len(engine_pods())
        with Load(url, clients=1) as trickle:  # the load falls: the freest pod drains by migration
            wait_for(lambda: len(engine_pods()) < peak, 180, "a drained pod deleted")
            wait_for(lambda: trickle.ok >= 3, 60, "requests after the scale-down")
        # what the run did is in Prometheus once the last scrapes of it landed (the drained pod's
        # series ended with it, hence the look back)
        wait_for(lambda: in_prometheus('llumnix_operator_scaling_events_total{reason="Released"}'), 30,
                 "the release scraped")
        committed = 'llumnix_llumlet_migrations_total{role="out",outcome="MIGRATION_OUTCOME_COMMITTED"}'
        wait_for(lambda: in_prometheus(f"last_over_time({committed}[10m])"), 30,
                 "a committed migration scraped")
        end = time.time()
    assert runner.exception is None, runner.output
    assert spike.failures == [] and trickle.failures == [], (spike.failures + trickle.failures)[:5]

    empty: list[str] = []
    only_zero: list[str] = []
    evaluated = 0
    for title, panels in render.dashboards().values():
        for panel in panels:
            for target in panel.targets:
                one = render.Panel(panel.dashboard, panel.title, panel.unit, (target,))
                series = render.evaluate(prometheus.url, one, start, end, SCRAPE_INTERVAL_S)
                evaluated += 1
                where = f"{title} / {panel.title}: {target.expr}"
                if not any(s.has_value for s in series):
                    if (panel.dashboard, panel.title) not in NO_DATA_IN_A_GOOD_RUN:
                        empty.append(where)
                elif not any(s.has_nonzero for s in series):
                    only_zero.append(where)
    assert evaluated > 30
    assert not empty, "panel queries without data in Prometheus:\n" + "\n".join(empty)
    print(f"\n[prometheus] {evaluated} panel queries over {end - start:.0f} s, peak {peak} pods, "
          f"{spike.ok + trickle.ok} requests; no data (listed): {sorted(NO_DATA_IN_A_GOOD_RUN)}")
    print("[prometheus] data, all zero:\n  " + "\n  ".join(only_zero))

    figures = os.environ.get("LLUMNIX_DASHBOARD_FIGURES")
    if figures:
        for path in render.render(prometheus.url, start, end, Path(figures), SCRAPE_INTERVAL_S):
            print(f"[prometheus] drew {path}")
