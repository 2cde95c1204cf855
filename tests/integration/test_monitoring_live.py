"""Proof with real parts: Debian's `prometheus` server scrapes, once a second, a `llumnix up` service of
two sim engines (its router and llumlets) and the cluster-in-a-test (the operator, the router it deploys
and every engine pod's llumlet, each pod a real sim engine + llumlet) while a load spike scales the
cluster's service up, a lowered instances.max drains a busy pod by live migration and the load's fall
drains the freest pod; then every query of every dashboard panel, evaluated by that Prometheus over the
run through its HTTP API (/api/v1/query_range, as Grafana does), returns data. The cluster's router and
llumlet targets carry the labels the chart's PodMonitors attach (`namespace`, `llmservice`), the
`llumnix up` ones none (as scraped outside Kubernetes): with the dashboards' namespace / LLMService
variables at All every query sees both services, with the cluster's service selected every per-service
query has data of that service alone (a migration latency quantile may be NaN: may_have_no_quantile),
and with a service that does not exist none has data.

With LLUMNIX_DASHBOARD_FIGURES=<folder> the run also draws each dashboard from that data
(scripts/render_dashboards.py), which is how docs/figures/dashboards/*.png are made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import kubernetes
import pytest
from cluster_harness import Load, wait_for
from kube_emulator import EmulatedCluster
from kubelet_emulator import Kubelet
from prometheus_client.parser import text_string_to_metric_families
from script_module import load_script
from test_local_mode import processes_using, read_until, up, write_manifest
from test_operator_cluster import (  # noqa: F401 (cluster is a fixture)
    MERGE,
    NS,
    G,
    P,
    V,
    cluster,
    operator_and_kubelet,
    start_autoscaled_service,
)

from llumnix.launch.pair import free_port
from llumnix_operator.http_endpoint import OperatorEndpoint
from llumnix_operator.metrics import OPERATOR_METRICS
from llumnix_operator.naming import LLUMLET_HTTP_PORT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("prometheus_path"),  # skips (or fails) before the cluster starts for nothing
]
ROOT = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL_S = 1.0
ROUTER_PORT = 8000
SERVICE = "live"
"""The cluster's LLMService."""
F = 'namespace=~"$namespace", llmservice=~"$llmservice"'
"""The dashboards' filter on router and llumlet series."""
ZERO_IN_A_GOOD_RUN = {
    f"llumnix_llumlet_recent_preemptions{{{F}}}": "no engine is overloaded into preempting requests",
    f"llumnix_llumlet_waiting_requests{{{F}}}":
        "a sim engine runs every request it admits while it has blocks",
    f'llumnix_llumlet_load_source{{source="metrics-fallback", {F}}}':
        "every sim engine publishes its snapshots",
    f"sum(llumnix_router_queue_length{{{F}}})": "the router queues only while every instance is busy",
    f"sum(rate(llumnix_router_retries_total{{{F}}}[$__rate_interval]))": "no dispatch fails",
    f"sum(rate(llumnix_router_replays_total{{{F}}}[$__rate_interval]))": "no stream breaks",
    "sum by (stage) (rate(llumnix_operator_errors_total[$__rate_interval]))": "no reconcile or tick fails",
}
"""Queries that may stay at zero in this run, with the reason; every query must return data and every
other one must show a non-zero value at some point (the scale-up, the migrations, the drain)."""


def may_have_no_quantile(expr: str) -> bool:
    """A migration latency quantile of the cluster's service alone: its migrations that surely were
    scraped may all be a drained pod's, whose last scrape may come before they end (every histogram
    rate at 0 makes the quantile NaN); the committed migration the test waits for is `llumnix up`'s."""
    return expr.startswith("histogram_quantile(") and "llumnix_llumlet_migration_" in expr


class Prometheus:
    """Debian's prometheus server with one job per component, each fed by a file_sd target file the
    test rewrites as pods come and go."""

    JOBS = ("router", "llumlet", "operator")

    def __init__(self, binary: str, work: Path) -> None:
        self.binary = binary
        self.work = work
        self.url = ""
        self._process: subprocess.Popen | None = None

    def set_targets(self, job: str, addresses: Sequence[str], labelled: Sequence[str] = (),
                    labels: dict[str, str] | None = None) -> None:
        """The job's targets: the addresses without target labels of their own, the labelled ones with
        the labels."""
        path = self.work / f"{job}.json"
        staged = path.with_suffix(".tmp")
        groups = [{"targets": sorted(addresses)}, {"targets": sorted(labelled), "labels": labels or {}}]
        staged.write_text(json.dumps(groups))
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
        log = self.work / "prometheus.log"
        for _ in range(3):  # the free port found may be taken by another process before prometheus binds it
            address = f"127.0.0.1:{free_port()}"
            self.url = f"http://{address}"
            self._process = subprocess.Popen(
                [self.binary, f"--config.file={self.work / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.work / 'data'}", f"--web.listen-address={address}",
                 "--log.level=warn"],
                stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            )
            if wait_for(self._ready_or_exited, 60, "prometheus /-/ready") == "ready":
                return self
        raise AssertionError(f"prometheus did not start: {log.read_text()}")

    def _ready_or_exited(self) -> str:
        if self._process.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return "ready" if response.status == 200 else ""
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


class LocalService:
    """`llumnix up` of two sim engines, as a user runs it; its router and llumlets are scrape targets."""

    def __init__(self, tmp_path: Path) -> None:
        self.manifest = write_manifest(tmp_path / "local.yaml", instances=2)
        self.work_dir = tmp_path / "local-work"
        self.router = ""  # host:port, as `llumnix up` prints it
        self.llumlets: list[str] = []

    def __enter__(self) -> LocalService:
        self._process = up(self.manifest, self.work_dir)  # every port chosen free by llumnix up
        serving = r"serving 'sim' at http://(\S+)/v1 .*admin API at (http://\S+) "
        match, _ = read_until(self._process, serving, 180)
        self.router, self.admin_url = match.group(1), match.group(2)
        # the status line repeats: keep reading, or a full pipe would stall the service
        threading.Thread(target=self._process.stdout.read, daemon=True).start()
        for pid in processes_using(self.work_dir):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "llumlet" in argv and "--http-port" in argv:
                host, port = (argv[argv.index(flag) + 1] for flag in ("--host", "--http-port"))
                self.llumlets.append(f"{host}:{port}")
        assert len(self.llumlets) == 2, self.llumlets
        return self

    @property
    def url(self) -> str:
        return f"http://{self.router}"

    def migrate(self, source: str, destination: str) -> str:
        """`llumnix admin migrate` of the source's choice of request; the outcome."""
        answer = subprocess.run(
            [sys.executable, "-m", "llumnix.cli", "admin", "migrate", "--url", self.admin_url, "--json",
             "--source", source, "--destination", destination],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
        return json.loads(answer.stdout)["outcome"]

    def __exit__(self, *exc: object) -> None:
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(60)
        finally:
            for pid in processes_using(self.work_dir):  # never leave processes behind
                os.kill(pid, signal.SIGKILL)


class TargetFeeder:
    """Keeps the target files current: the routers, every llumlet (the local service's and every engine
    pod's), the operator. The cluster's pods carry the labels the chart's PodMonitors attach:
    Prometheus Operator's `namespace` and `llmservice` from the pod label llumnix.io/service."""

    def __init__(self, prometheus: Prometheus, local: LocalService, kubelet: Kubelet,
                 operator_port: int) -> None:
        self.prometheus = prometheus
        self.local = local
        self.kubelet = kubelet
        prometheus.set_targets("operator", [f"127.0.0.1:{operator_port}"])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            routers = [f"{pod.ip}:{ROUTER_PORT}" for pod in list(self.kubelet.routers.values())]
            llumlets = [f"{pod.ip}:{LLUMLET_HTTP_PORT}" for pod in list(self.kubelet.pods.values())]
            labels = {"namespace": self.kubelet.namespace, "llmservice": SERVICE}
            self.prometheus.set_targets("router", [self.local.router], routers, labels)
            self.prometheus.set_targets("llumlet", self.local.llumlets, llumlets, labels)

    def __enter__(self) -> TargetFeeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def prometheus(prometheus_path: str, tmp_path: Path) -> Iterator[Prometheus]:
    work = tmp_path / "prometheus"
    work.mkdir()
    with Prometheus(prometheus_path, work) as server:
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
    cluster: EmulatedCluster, prometheus: Prometheus, operator_endpoint: OperatorEndpoint,  # noqa: F811
    tmp_path: Path,
) -> None:
    render = load_script("render_dashboards")
    custom = kubernetes.client.CustomObjectsApi(
        kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)))

    def status() -> dict:
        return cluster.emulator.live("llmservices").get(SERVICE, {}).get("status") or {}

    def ready() -> int:
        return (status().get("instances") or {}).get("ready", 0)

    def engine_pods() -> set[str]:
        return {n for n in cluster.emulator.live("pods") if n.startswith(f"{SERVICE}-engine-")}

    def in_prometheus(expr: str) -> bool:
        return bool(prometheus.query(expr))

    def all_busy() -> bool:
        summaries = status().get("instanceSummaries") or []
        return len(summaries) == len(engine_pods()) and all(i.get("running", 0) >= 1 for i in summaries)

    def set_instances(**bounds: int) -> None:
        patch = {"spec": {"instances": bounds}}
        custom.patch_namespaced_custom_object(G, V, NS, P, SERVICE, patch, _content_type=MERGE)

    def committed_out(pod: str) -> float:
        """Migrations the pod's llumlet committed as their source (0 once the pod is gone)."""
        ip = getattr(kubelet.pods.get(pod), "ip", None)
        try:
            with urllib.request.urlopen(f"http://{ip}:{LLUMLET_HTTP_PORT}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return 0.0
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "llumnix_llumlet_migrations_total"
                   and s.labels == {"role": "out", "outcome": "MIGRATION_OUTCOME_COMMITTED"})

    def drain_a_busy_instance(attempts: int = 3) -> None:
        """A drain that must migrate, driven. The autoscaler drains the freest instance, which may hold
        no request (a hogged run's did not: no migration, no move for the router to follow), and eight
        clients over two instances leave no destination the migration rule admits (a fresh-clone run
        stopped at two instances and moved nothing). So instances.min holds three instances until
        every one runs a request, then instances.max 2 drains the freest: the other two hold at most
        seven requests, one of them three or fewer, with room for a fourth. When the drained
        instance's requests all end before its drain starts, it is released empty: then the drain is
        tried again."""
        for _ in range(attempts):
            set_instances(min=3, max=3)
            wait_for(lambda: ready() == 3 and len(engine_pods()) == 3, 180, "three instances")
            wait_for(all_busy, 60, "requests running on every instance")
            before = {pod: committed_out(pod) for pod in engine_pods()}
            set_instances(min=1, max=2)

            def drain_ended(before: dict[str, float] = before) -> str | None:
                drained = [i["name"] for i in status().get("instanceSummaries") or [] if i.get("draining")]
                if any(committed_out(pod) > before.get(pod, 0.0) for pod in drained):
                    return "migrated"
                return "released" if len(engine_pods()) < 3 else None

            if wait_for(drain_ended, 120, "the drained instance's migration or its release") == "migrated":
                wait_for(lambda: len(engine_pods()) < 3, 120, "the drained instance released")
                return
        raise AssertionError(f"{attempts} drains of a busy instance ended without a migration")

    with LocalService(tmp_path) as local, Load(local.url, clients=2) as local_load, \
            operator_and_kubelet(cluster) as (kubelet, runner), \
            TargetFeeder(prometheus, local, kubelet, operator_endpoint.port):
        start = time.time()  # scraping starts
        url = start_autoscaled_service(cluster, kubelet, SERVICE)

        with Load(url, clients=8) as spike:  # a scale-up
            wait_for(lambda: ready() >= 2 and len(engine_pods()) >= 2, 180, "a scale-up by the autoscaler")
            wait_for(lambda: spike.ok >= 10, 120, "requests served after the scale-up")
            drain_a_busy_instance()
            moves = f'llumnix_router_moves_followed_total{{llmservice="{SERVICE}"}} > 0'
            wait_for(lambda: in_prometheus(moves), 30, "the router's followed move scraped")
        peak = len(engine_pods())
        with Load(url, clients=1) as trickle:  # the load falls: the freest pod drains
            wait_for(lambda: len(engine_pods()) < peak, 180, "a drained pod deleted")
            wait_for(lambda: trickle.ok >= 3, 60, "requests after the scale-down")
        # what the run did is in Prometheus once the last scrapes of it landed
        wait_for(lambda: in_prometheus('llumnix_operator_scaling_events_total{reason="Released"} > 0'), 30,
                 "the release scraped")
        # migrations on the `llumnix up` service too, whose llumlets stay (a drained pod's last
        # scrape may come before its migrations end). Two, each scraped, from the same source: a
        # histogram's series appears with its first observation, and the panels' rate() needs it to
        # rise between two scrapes.
        downtime = "llumnix_llumlet_migration_downtime_seconds_count"
        for count in (1, 2):
            wait_for(lambda: local.migrate("local-0", "local-1") == "committed", 60,
                     "`llumnix admin migrate`")
            wait_for(lambda count=count: any(in_prometheus(f'{downtime}{{instance="{llumlet}"}} >= {count}')
                                             for llumlet in local.llumlets), 30,
                     f"committed migration {count} scraped")
        for llumlet in local.llumlets:  # the local service was scraped too
            assert in_prometheus(f'max_over_time(llumnix_llumlet_total_blocks{{instance="{llumlet}"}}[10m])')
        assert in_prometheus(f'llumnix_router_requests_total{{instance="{local.router}",status="200"}} > 0')
        namespace = kubelet.namespace
        end = time.time()
    assert runner.exception is None, runner.output
    failures = spike.failures + trickle.failures + local_load.failures
    assert failures == [], failures[:5]

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
                    empty.append(where)
                elif not any(s.has_nonzero for s in series) and target.expr not in ZERO_IN_A_GOOD_RUN:
                    only_zero.append(where)
    assert evaluated > 30
    assert not empty, "panel queries without data in Prometheus:\n" + "\n".join(empty)
    assert not only_zero, "panel queries that stayed at zero through the run:\n" + "\n".join(only_zero)
    print(f"\n[prometheus] {evaluated} panel queries over {end - start:.0f} s, peak {peak} pods, "
          f"{spike.ok + trickle.ok} requests to the cluster, {local_load.ok} to `llumnix up`; "
          f"all with data, {len(ZERO_IN_A_GOOD_RUN)} allowed to stay at zero")

    # the namespace / LLMService variables: the cluster's service alone, then one that does not exist
    selected = render.selecting(namespace, SERVICE)
    nowhere = render.selecting(namespace, "no-such-service")
    empty, leaked, unfiltered, filtered = [], [], [], 0
    for title, panels in render.dashboards().values():
        for panel in panels:
            for target in panel.targets:
                if "$llmservice" not in target.expr:  # the operator's own series
                    continue
                filtered += 1
                one = render.Panel(panel.dashboard, panel.title, panel.unit, (target,))
                where = f"{title} / {panel.title}: {target.expr}"
                series = render.evaluate(prometheus.url, one, start, end, SCRAPE_INTERVAL_S, selected)
                if not any(s.has_value for s in series) and not may_have_no_quantile(target.expr):
                    empty.append(where)
                leaked += [f"{where}: {s.legend}" for s in series if "local-" in s.legend]
                if render.evaluate(prometheus.url, one, start, end, SCRAPE_INTERVAL_S, nowhere):
                    unfiltered.append(where)
    assert filtered > 25
    assert not empty, f"panel queries without data for {namespace}/{SERVICE}:\n" + "\n".join(empty)
    assert not leaked, "the `llumnix up` service's instances in the cluster service's panels:\n" + \
        "\n".join(leaked)
    assert not unfiltered, "panel queries with data for a service that does not exist:\n" + \
        "\n".join(unfiltered)
    print(f"[prometheus] {filtered} per-service panel queries: data for {namespace}/{SERVICE} alone, "
          "none for a service that does not exist")

    figures = os.environ.get("LLUMNIX_DASHBOARD_FIGURES")
    if figures:
        for path in render.render(prometheus.url, start, end, Path(figures), SCRAPE_INTERVAL_S):
            print(f"[prometheus] drew {path}")
