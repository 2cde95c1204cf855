"""Cluster in a test: the operator (KopfRunner) against the emulated API server, with a fake kubelet
that runs each engine pod the operator creates as real local processes (sim engine + llumlet, from the
pod's own command, args and env) and the router from its Deployment. Requests flow through the router
while the service scales up, loses a pod, and scales down by drain-then-delete (live migration
between pods); none may fail."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kopf
import kubernetes
import pytest
from cluster_harness import Load, healthy, sim_service, wait_for
from kopf.testing import KopfRunner
from kube_emulator import EmulatedCluster
from kubelet_emulator import Kubelet
from prometheus_client.parser import text_string_to_metric_families

from llumnix_operator import handlers
from llumnix_operator.metrics import OPERATOR_METRICS
from llumnix_operator.naming import LLUMLET_HTTP_PORT

pytestmark = pytest.mark.slow
G, V, P, NS = "llumnix.io", "v1alpha1", "llmservices", "default"
MERGE = "application/merge-patch+json"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path) as emulated:
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        monkeypatch.setattr(
            kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(emulated.kubeconfig)
        )
        handlers.api_client.cache_clear()
        yield emulated
        handlers.api_client.cache_clear()


@contextlib.contextmanager
def operator_and_kubelet(cluster: EmulatedCluster) -> Iterator[tuple[Kubelet, KopfRunner]]:
    """The fake kubelet and the operator (kopf in a thread) against the emulated API server."""
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.watching.server_timeout = 5
    with (
        Kubelet(cluster.url) as kubelet,
        KopfRunner(["run", "--standalone", "-n", NS, "-m", "llumnix_operator.handlers"],
                   settings=settings, timeout=120) as runner,
    ):
        yield kubelet, runner


def test_requests_survive_scaling_failure_and_drain(cluster: EmulatedCluster) -> None:
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url))
    custom = kubernetes.client.CustomObjectsApi(api)

    def status() -> dict:
        return cluster.emulator.live("llmservices").get("sim", {}).get("status") or {}

    def ready() -> int:
        return (status().get("instances") or {}).get("ready", 0)

    def engine_pods() -> set[str]:
        return {n for n in cluster.emulator.live("pods") if n.startswith("sim-engine-")}

    with operator_and_kubelet(cluster) as (kubelet, runner):
        custom.create_namespaced_custom_object(G, V, NS, P, sim_service("sim", 2))
        wait_for(lambda: ready() == 2, 120, "two ready instances")
        wait_for(lambda: "sim-router" in kubelet.routers, 30, "the router")
        url = kubelet.router_url("sim-router", 8000)
        wait_for(lambda: healthy(url), 60, "the router's /health")

        # Requests of 512 tokens (about 12 s on a sim engine) outlive a drain's migrations: with 128
        # (about 3 s) a CI run's drained requests all finished on their sources before a move committed.
        with Load(url, max_tokens=512) as load:
            wait_for(lambda: load.ok >= 5, 60, "requests through the router")

            custom.patch_namespaced_custom_object_scale(
                G, V, NS, P, "sim", {"spec": {"replicas": 3}}, _content_type=MERGE
            )
            wait_for(lambda: ready() == 3, 120, "scale-up to three")

            victim = sorted(engine_pods())[0]
            kubelet.kill(victim)
            wait_for(lambda: victim not in engine_pods(), 60, "the killed pod removed")
            wait_for(lambda: ready() == 3 and len(engine_pods()) == 3, 120, "the killed pod replaced")

            done_before = load.ok

            def all_busy() -> bool:
                summaries = status().get("instanceSummaries") or []
                return len(summaries) == 3 and all(i.get("running", 0) >= 1 for i in summaries)

            wait_for(all_busy, 60, "requests running on every instance")  # so the drains must migrate
            custom.patch_namespaced_custom_object_scale(
                G, V, NS, P, "sim", {"spec": {"replicas": 1}}, _content_type=MERGE
            )
            wait_for(lambda: len(engine_pods()) == 1 and ready() == 1, 180, "scale-down to one")
            wait_for(lambda: load.ok >= done_before + 5, 60, "requests after the scale-down")

        reasons = [e.get("reason") for e in cluster.emulator.live("events").values()]
        assert {"ScaledUp", "InstanceFailed", "Replaced", "Draining", "Released"} <= set(reasons), reasons
        assert kubelet.errors == []
    assert runner.exception is None, runner.output
    # Requests on the killed pod are resumed elsewhere by the router; drained pods migrate theirs out.
    assert load.failures == [], load.failures[:5]
    # Every instance was busy at the scale-down, so the two drained ones had requests to migrate out.
    migrations = status()["migrations"]
    assert migrations["completed"] >= 1, migrations
    print(f"\n[cluster] {load.ok} requests ok, migrations {migrations}")


DASHBOARDS = Path(__file__).resolve().parents[2] / "charts/llumnix/dashboards"
ONLY_AFTER_A_FAILURE = {"llumnix_operator_errors_total"}
"""Dashboard series that exist only once something failed (labelled by stage): none did here."""


def dashboard_metric_names() -> set[str]:
    """Every llumnix_* series a dashboard panel queries (our names all start with llumnix_; no label does)."""
    names: set[str] = set()
    for path in DASHBOARDS.glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                names |= set(re.findall(r"\bllumnix_[a-z0-9_]+", target["expr"]))
    return names


class MetricsSampler:
    """Scrapes the router, every engine pod's llumlet and the operator every second while the test
    runs, remembering which series had samples (pods come and go, so one scrape at the end would miss
    the drained pod's migrations)."""

    def __init__(self, kubelet: Kubelet, router_url: str) -> None:
        self.kubelet = kubelet
        self.router_url = router_url
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scrape(self, url: str) -> None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return  # a pod that just went away
        self.seen |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._scrape(f"{self.router_url}/metrics")
            for pod in list(self.kubelet.pods.values()):
                self._scrape(f"http://{pod.ip}:{LLUMLET_HTTP_PORT}/metrics")
            text = OPERATOR_METRICS.exposition().decode()
            self.seen |= {s.name for f in text_string_to_metric_families(text) for s in f.samples}

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def start_autoscaled_service(cluster: EmulatedCluster, kubelet: Kubelet, name: str) -> str:
    """Creates an LLMService autoscaled between 1 and 3 sim pods of 64 KV blocks and waits for its first
    instance and its router; the router's URL."""
    custom = kubernetes.client.CustomObjectsApi(
        kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)))
    custom.create_namespaced_custom_object(G, V, NS, P, {
        "apiVersion": f"{G}/{V}",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "sim"},
            "instances": {"min": 1, "max": 3},
            # 64 blocks of 16 tokens: six 139-token requests nearly fill one instance
            "engine": {"runtime": "sim", "resources": {"gpus": 0}, "args": ["--num-blocks", "64"]},
            "migration": {"intervalMs": 200},
            "autoscaling": {"enabled": True, "scaleUpBelow": 10, "scaleDownAbove": 40,
                            "intervalSeconds": 1, "scaleDownStabilizationSeconds": 3,
                            "startupGraceSeconds": 120, "parkSeconds": 0},  # deleted once empty
        },
    })

    def ready() -> int:
        status = cluster.emulator.live("llmservices").get(name, {}).get("status") or {}
        return (status.get("instances") or {}).get("ready", 0)

    wait_for(lambda: ready() == 1, 120, "the first instance")
    wait_for(lambda: f"{name}-router" in kubelet.routers, 30, "the router")
    url = kubelet.router_url(f"{name}-router", 8000)
    wait_for(lambda: healthy(url), 60, "the router's /health")
    return url


def test_pods_autoscaled_by_freeness(cluster: EmulatedCluster) -> None:
    """Built-in autoscaling: a load spike drops the aggregate freeness (now or one start-up ahead)
    below scaleUpBelow and the operator creates pods (publishing spec.replicas); when the load falls
    the aggregate freeness with one instance removed exceeds scaleDownAbove, and the freest pod is
    drained and deleted. No client request fails; status, events and the operator's metrics show
    each step."""
    def live() -> dict:
        return cluster.emulator.live("llmservices").get("auto", {})

    def ready() -> int:
        return ((live().get("status") or {}).get("instances") or {}).get("ready", 0)

    def engine_pods() -> set[str]:
        return {n for n in cluster.emulator.live("pods") if n.startswith("auto-engine-")}

    def scaling_events(direction: str, reason: str) -> float:
        return OPERATOR_METRICS.registry.get_sample_value(
            "llumnix_operator_scaling_events_total",
            {"llmservice_namespace": NS, "llmservice": "auto", "direction": direction, "reason": reason},
        ) or 0.0

    replicas_seen: list[int] = []
    with operator_and_kubelet(cluster) as (kubelet, runner):
        url = start_autoscaled_service(cluster, kubelet, "auto")

        with MetricsSampler(kubelet, url) as sampler, Load(url, clients=8) as load:
            def scaled_up() -> bool:
                replicas_seen.append((live().get("spec") or {}).get("replicas", 0))
                return ready() >= 2 and len(engine_pods()) >= 2
            wait_for(scaled_up, 180, "a scale-up by the autoscaler")
            assert max(replicas_seen) >= 2  # the loop's count, published to the /scale subresource
            decision = live()["status"]["lastScaling"]
            # The autoscaler scales up on the demand one start-up ahead (a rising load can start
            # instances while the freeness now is still above scaleUpBelow); its reason says both.
            ahead = re.search(r"aggregate freeness [-\d.]+, ([-\d.]+) one start-up ahead.* < 10: \d+ more",
                              decision.get("reason", ""))
            assert decision["action"] == "scale-up" and ahead, decision
            assert float(ahead[1]) <= 10, decision  # printed to 0.1
            assert float(ahead[1]) <= decision["aggregateFreeness"] + 0.05, decision  # rising demand only
            wait_for(lambda: load.ok >= 10, 120, "requests served after the scale-up")
        peak = len(engine_pods())

        with MetricsSampler(kubelet, url) as after, Load(url, clients=1) as trickle:  # the load falls
            wait_for(lambda: len(engine_pods()) < peak, 180, "a drained pod deleted")
            wait_for(lambda: trickle.ok >= 3, 60, "requests after the scale-down")
        status = live()["status"]
        reasons = [e.get("reason") for e in cluster.emulator.live("events").values()]
        assert {"ScaledUp", "Draining", "Released"} <= set(reasons), reasons
        assert kubelet.errors == []
    assert runner.exception is None, runner.output
    assert load.failures == [] and trickle.failures == [], (load.failures + trickle.failures)[:5]
    assert (live().get("spec") or {}).get("replicas", 0) < peak
    assert status["lastScaling"]["action"] in ("drain", "release"), status["lastScaling"]
    assert scaling_events("up", "ScaledUp") >= 1 and scaling_events("down", "Released") >= 1
    # Every series a dashboard queries had data in this run (a scale-up, a drain with migrations).
    missing = dashboard_metric_names() - sampler.seen - after.seen - ONLY_AFTER_A_FAILURE
    assert not missing, sorted(missing)
    print(f"\n[autoscale] peak {peak} pods, {load.ok + trickle.ok} requests ok, "
          f"migrations {status['migrations']}, last {status['lastScaling']}")
