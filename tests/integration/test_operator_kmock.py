"""The operator (kopf, run through KopfRunner) against an emulated Kubernetes API (kmock): what it
sends when an LLMService is applied, changed, scaled and its pods fail, and that a restart changes
nothing. There is no kubelet here: pods stay pending unless a test writes their status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kopf
import kubernetes
import pytest
from cluster_harness import wait_for
from kopf.testing import KopfRunner
from kube_emulator import EmulatedCluster

from llumnix_operator import handlers
from llumnix_operator.metrics import OPERATOR_METRICS, PREFIX

G, V, P, NS = "llumnix.io", "v1alpha1", "llmservices", "default"
OWNED = (
    "pods",
    "secrets",
    "services",
    "deployments",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "poddisruptionbudgets",
)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path) as emulated:
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        monkeypatch.setattr(
            kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(emulated.kubeconfig)
        )
        monkeypatch.setenv("LLUMNIX_IMAGE", "reg/llumnix:test")
        handlers.api_client.cache_clear()
        yield emulated
        handlers.api_client.cache_clear()


def client(cluster: EmulatedCluster) -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url))


def operator() -> KopfRunner:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True  # kmock 0.8 cannot list namespaces
    settings.watching.server_timeout = 5
    return KopfRunner(
        ["run", "--standalone", "-n", NS, "-m", "llumnix_operator.handlers"], settings=settings, timeout=60
    )



def reconciles(result: str) -> float:
    return OPERATOR_METRICS.registry.get_sample_value(f"{PREFIX}_reconciles_total", {"result": result}) or 0.0


def wait_for_ticks(count: int, timeout: float = 60.0) -> None:
    """Until the operator (in this process) has finished `count` more control-loop ticks."""
    def ticks() -> float:
        return OPERATOR_METRICS.registry.get_sample_value(f"{PREFIX}_loop_tick_duration_seconds_count") or 0.0

    target = ticks() + count
    wait_for(lambda: ticks() >= target, timeout=timeout, what=f"{count} control-loop ticks")


ENGINE_AFFINITY = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
    "weight": 100,
    "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"llumnix.io/service": "llama"}}},
}]}}
ROUTER_SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                 "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}}}


def llmservice(replicas: int = 2) -> dict:
    return {
        "apiVersion": f"{G}/{V}",
        "kind": "LLMService",
        "metadata": {"name": "llama"},
        "spec": {
            "model": {"name": "tiny"},
            "replicas": replicas,
            "instances": {"min": 1, "max": 4},
            "engine": {"runtime": "sim", "resources": {"gpus": 0, "affinity": ENGINE_AFFINITY}},
            "autoscaling": {"startupGraceSeconds": 600},
            "router": {"nodeSelector": {"pool": "cpu"}, "topologySpreadConstraints": [ROUTER_SPREAD]},
        },
    }


def engine_pods(cluster: EmulatedCluster) -> dict[str, dict]:
    return {
        name: pod for name, pod in cluster.emulator.live("pods").items() if name.startswith("llama-engine-")
    }


def status_of(cluster: EmulatedCluster) -> dict:
    return cluster.emulator.live("llmservices").get("llama", {}).get("status") or {}


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions") or []}


def event_reasons(cluster: EmulatedCluster) -> list[str]:
    return [e.get("reason") for e in cluster.emulator.live("events").values()]


def set_pod_status(cluster: EmulatedCluster, name: str, status: dict) -> None:
    kubernetes.client.CoreV1Api(client(cluster)).patch_namespaced_pod_status(
        name, NS, {"status": status}, _content_type="application/merge-patch+json"
    )


def test_apply_scale_fail_and_restart(cluster: EmulatedCluster) -> None:
    custom = kubernetes.client.CustomObjectsApi(client(cluster))
    with operator() as runner:
        created = custom.create_namespaced_custom_object(G, V, NS, P, llmservice())
        uid = created["metadata"]["uid"]

        # Everything the service owns, with an owner reference to it.
        wait_for(lambda: len(engine_pods(cluster)) == 2, what="two engine pods")
        wait_for(lambda: cluster.emulator.live("poddisruptionbudgets"), what="the last owned object")
        owned = {plural: cluster.emulator.live(plural) for plural in OWNED}
        assert set(owned["services"]) == {"llama-llumlets", "llama-router"}
        assert set(owned["deployments"]) == {"llama-router"}
        assert (
            set(owned["serviceaccounts"])
            == set(owned["roles"])
            == set(owned["rolebindings"])
            == {"llama-llumnix"}
        )
        assert set(owned["poddisruptionbudgets"]) == {"llama-engine", "llama-router"}
        assert set(owned["secrets"]) == {"llama-llumlet-token"}  # the llumlets' service token
        token = owned["secrets"]["llama-llumlet-token"]["data"]["token"]
        for plural, objects in owned.items():
            for name, obj in objects.items():
                refs = obj["metadata"].get("ownerReferences") or []
                assert [r["uid"] for r in refs] == [uid], f"{plural}/{name} is not owned by the LLMService"
        router_pod = owned["deployments"]["llama-router"]["spec"]["template"]["spec"]
        assert router_pod["nodeSelector"] == {"pool": "cpu"}  # placement, as the spec gives it
        assert router_pod["topologySpreadConstraints"] == [ROUTER_SPREAD]
        assert all(p["spec"]["affinity"] == ENGINE_AFFINITY for p in engine_pods(cluster).values())
        router = router_pod["containers"][0]
        assert router["image"] == "reg/llumnix:test"
        assert "llama-llumlets.default.svc:50051" in router["args"]

        # Status: pods are pending, so nothing is ready yet.
        status = wait_for(
            lambda: (s := status_of(cluster)).get("instances") == {"ready": 0, "desired": 2} and s,
            what="status with 0/2 ready",
        )
        assert conditions(status)["Ready"] == ("False", "NoInstanceServing")
        assert status["selector"] == "llumnix.io/service=llama,app.kubernetes.io/component=engine"
        assert wait_for(lambda: event_reasons(cluster).count("ScaledUp") >= 2, what="ScaledUp events")

        # A pod the kubelet reports ready counts as a ready instance.
        first, second = sorted(engine_pods(cluster))
        set_pod_status(
            cluster,
            first,
            {"phase": "Running", "podIP": "192.0.2.10", "conditions": [{"type": "Ready", "status": "True"}]},
        )
        status = wait_for(lambda: (s := status_of(cluster))["instances"]["ready"] == 1 and s, what="1 ready")
        assert {i["name"]: i["phase"] for i in status["instanceSummaries"]} == {
            first: "ready",
            second: "starting",
        }

        # /scale (kubectl scale, HPA) sets the count; the loop follows it.
        custom.patch_namespaced_custom_object_scale(
            G, V, NS, P, "llama", {"spec": {"replicas": 3}}, _content_type="application/merge-patch+json"
        )
        wait_for(lambda: len(engine_pods(cluster)) == 3, what="a third engine pod")
        wait_for(lambda: status_of(cluster)["instances"]["desired"] == 3, what="desired 3 in the status")

        # A spec change reaches the owned objects; a placement field removed from the spec leaves the
        # router Deployment too (its merge patch alone would leave it there).
        custom.patch_namespaced_custom_object(
            G,
            V,
            NS,
            P,
            "llama",
            {"spec": {"router": {"replicas": 3, "nodeSelector": None}}},
            _content_type="application/merge-patch+json",
        )
        deployment = wait_for(
            lambda: (d := cluster.emulator.live("deployments")["llama-router"])["spec"]["replicas"] == 3
            and "nodeSelector" not in d["spec"]["template"]["spec"] and d,
            what="router scaled to 3 without its nodeSelector",
        )
        assert deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] == [ROUTER_SPREAD]

        # A failed pod is deleted and replaced.
        set_pod_status(cluster, second, {"phase": "Failed", "message": "OOMKilled"})
        wait_for(
            lambda: second not in engine_pods(cluster) and len(engine_pods(cluster)) == 3,
            what="the failed pod replaced",
        )
        wait_for(
            lambda: {"InstanceFailed", "Replaced"} <= set(event_reasons(cluster)), what="replacement events"
        )

        # An invalid spec the schema cannot catch is a condition, and nothing is torn down.
        custom.patch_namespaced_custom_object(
            G,
            V,
            NS,
            P,
            "llama",
            {"spec": {"instances": {"min": 5}}},
            _content_type="application/merge-patch+json",
        )
        status = wait_for(
            lambda: (s := status_of(cluster)) and conditions(s)["Degraded"][1] == "InvalidSpec" and s,
            what="InvalidSpec condition",
        )
        assert "instances.min must be <= instances.max" in next(
            c["message"] for c in status["conditions"] if c["type"] == "Degraded"
        )
        assert len(engine_pods(cluster)) == 3
        custom.patch_namespaced_custom_object(
            G,
            V,
            NS,
            P,
            "llama",
            {"spec": {"instances": {"min": 1}}},
            _content_type="application/merge-patch+json",
        )
        wait_for(
            lambda: conditions(status_of(cluster))["Degraded"][1] != "InvalidSpec", what="spec valid again"
        )
        # Two whole daemon ticks after that: the status the restarted operator finds is the settled one.
        wait_for_ticks(2)
    assert runner.exception is None, runner.output

    writes_before = len(list(cluster.emulator.writes()))
    pods_before = set(engine_pods(cluster))
    reconciled_before = reconciles("unchanged")
    with operator() as runner:
        # The restarted operator has run its resume handler and two whole control-loop ticks.
        wait_for(lambda: reconciles("unchanged") > reconciled_before, what="the resume handler ran")
        wait_for_ticks(2)
    assert runner.exception is None, runner.output
    after = list(cluster.emulator.writes())[writes_before:]
    assert [w for w in after if w[1] in OWNED or w[3] == "status"] == [], (
        "a restarted operator changed things"
    )
    assert cluster.emulator.live("secrets")["llama-llumlet-token"]["data"]["token"] == token  # not rotated
    assert set(engine_pods(cluster)) == pods_before
