"""The Helm chart lints and renders (Helm's own engine, via helm-python-sdk); its manifests and the
ones the operator builds validate against the Kubernetes API schemas (the operator's Role:
test_operator_rbac.py), its Prometheus Operator objects against the published CRDs' schemas
(tests/schemas/prometheus-operator)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from custom_resources import PROMETHEUS_OPERATOR_CRDS, CRDSchemas

from llumnix.service_spec import ServiceSettings, validate_spec
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.engine_pod import engine_pod
from llumnix_operator.handlers import owned_objects
from llumnix_operator.router import router_deployment

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (dev extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed"
)

CHART = Path(__file__).resolve().parents[2] / "charts/llumnix"
KUBE_VERSION = "1.33"


def render(values: dict | None = None) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    try:
        rendered = chart.render(values or {}, name="rel", namespace="llumnix")
    finally:
        chart.close()
    return [doc for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_chart_lints_without_warnings() -> None:
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("all_namespaces", [True, False])
def test_rendered_manifests_are_valid(all_namespaces: bool) -> None:
    docs = render({"operator": {"allNamespaces": all_namespaces, "replicas": 2}})
    kinds = sorted(d["kind"] for d in docs)
    role = "ClusterRole" if all_namespaces else "Role"
    peering = "ClusterKopfPeering" if all_namespaces else "KopfPeering"
    assert kinds == sorted(["Deployment", "ServiceAccount", role, f"{role}Binding", peering])
    for doc in docs:
        if doc["apiVersion"] != "kopf.dev/v1":  # a custom resource: its CRD ships in crds/
            validate(doc)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["llumnix"] and container["args"][0] == "operator"
    assert "--peering=llumnix" in container["args"]
    assert ("--all-namespaces" in container["args"]) == all_namespaces
    assert {"name": "LLUMNIX_IMAGE", "value": "ghcr.io/llumnix/llumnix:0.1.0"} in container["env"]


def test_chart_ships_the_generated_crd() -> None:
    crd = yaml.safe_load((CHART / "crds/llmservices.llumnix.io.yaml").read_text())
    validate(crd)
    assert crd["metadata"]["name"] == "llmservices.llumnix.io"


def test_operator_built_manifests_are_valid() -> None:
    settings = ServiceSettings(
        "llama",
        "prod",
        validate_spec(
            {
                "model": {"name": "llama", "source": {"pvc": "models"}},
                "engine": {
                    "resources": {
                        "gpus": 1,
                        "memory": "32Gi",
                        "tolerations": [{"key": "gpu", "operator": "Exists"}],
                        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 50, "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"llumnix.io/service": "llama"}}}}]}},
                    }
                },
                "router": {
                    "apiKeySecret": "keys",
                    "nodeSelector": {"pool": "cpu"},
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}}}],
                },
            }
        ),
    )
    config = BuildConfig()
    for manifest in [*owned_objects(settings, config), engine_pod(settings, config)]:
        validate(manifest)


def test_monitoring_objects_and_dashboards_when_asked() -> None:
    docs = render({"monitoring": {"enabled": True, "labels": {"release": "kps"}},
                   "dashboards": {"enabled": True}})
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    monitors = {m["metadata"]["name"]: m for m in by_kind["PodMonitor"]}
    assert set(monitors) == {"rel-llumnix-operator", "rel-llumnix-operator-routers",
                             "rel-llumnix-operator-engines"}
    assert all(m["metadata"]["labels"]["release"] == "kps" for m in monitors.values())
    engines = monitors["rel-llumnix-operator-engines"]["spec"]
    assert engines["selector"]["matchLabels"]["app.kubernetes.io/name"] == "llumnix-engine"
    assert engines["podMetricsEndpoints"][0]["port"] == "llumlet-http"
    assert engines["namespaceSelector"] == {"any": True}
    assert monitors["rel-llumnix-operator"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    rules = yaml.safe_load((CHART / "alerts/llumnix-alerts.yaml").read_text())
    assert by_kind["PrometheusRule"][0]["spec"] == rules
    dashboards = by_kind["ConfigMap"]
    assert sorted(d["metadata"]["name"] for d in dashboards) == [
        f"rel-llumnix-operator-dashboard-{n}" for n in ("instances", "migrations", "operator", "service")]
    for config_map in dashboards:
        validate(config_map)
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = config_map["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())


@pytest.mark.parametrize("enabled", ["auto", False])
def test_no_monitoring_objects_without_the_monitoring_api_or_when_off(enabled: object) -> None:
    """The default, `auto`, renders the Prometheus Operator's objects only where the cluster serves
    monitoring.coreos.com/v1: an offline render knows only Kubernetes' built-in APIs, as a cluster
    without the Prometheus Operator does (an install there would fail on the unknown kinds)."""
    kinds = {doc["kind"] for doc in render({"monitoring": {"enabled": enabled}})}
    assert not kinds & {"PodMonitor", "PrometheusRule"}, kinds
    assert "Deployment" in kinds  # the chart did render


POD_LABEL_META = "__meta_kubernetes_pod_label_"


def pod_label_meta_labels(pod: dict) -> set[str]:
    """The names Prometheus's pod discovery gives a pod's labels (each character outside [a-zA-Z0-9_]
    becomes _)."""
    return {POD_LABEL_META + re.sub(r"[^a-zA-Z0-9_]", "_", key) for key in pod["metadata"]["labels"]}


def test_each_pod_monitor_selects_its_pods_and_names_a_port_and_labels_they_have() -> None:
    """A PodMonitor whose selector matches no pod, or whose port its pods lack, scrapes nothing without
    a word: each must select exactly the pods it is for (the operator's, and the router and engine pods
    the operator builds) and name one of their container ports and labels."""
    docs = render({"monitoring": {"enabled": True}})
    monitors = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodMonitor"}
    settings = ServiceSettings("llama", "prod", validate_spec({"model": {"name": "llama"}}))
    config = BuildConfig()
    pods = {  # the pod (or pod template) each monitor is for
        "rel-llumnix-operator": next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"],
        "rel-llumnix-operator-routers": router_deployment(settings, config)["spec"]["template"],
        "rel-llumnix-operator-engines": engine_pod(settings, config),
    }
    assert set(monitors) == set(pods)
    for name, monitor in monitors.items():
        assert set(monitor["selector"]) == {"matchLabels"}, name  # the one kind of selector read here
        wanted = monitor["selector"]["matchLabels"].items()
        selected = [other for other, pod in pods.items() if wanted <= pod["metadata"]["labels"].items()]
        assert selected == [name]
        containers = pods[name]["spec"]["containers"]
        ports = {port["name"] for container in containers for port in container.get("ports", ())}
        for endpoint in monitor["podMetricsEndpoints"]:
            assert endpoint["port"] in ports, name
            sources = {label for r in endpoint.get("relabelings", ()) for label in r["sourceLabels"]}
            pod_labels_read = {label for label in sources if label.startswith(POD_LABEL_META)}
            assert pod_labels_read <= pod_label_meta_labels(pods[name]), name


MONITORING_GROUP = "monitoring.coreos.com/"


def monitoring_objects() -> list[dict]:
    docs = render({"monitoring": {"enabled": True, "labels": {"release": "kps"}}})
    return [d for d in docs if d["apiVersion"].startswith(MONITORING_GROUP)]


def test_monitoring_objects_validate_against_the_prometheus_operator_crds() -> None:
    crds = CRDSchemas(PROMETHEUS_OPERATOR_CRDS)
    objects = monitoring_objects()
    assert sorted(o["kind"] for o in objects) == ["PodMonitor"] * 3 + ["PrometheusRule"]
    for obj in objects:
        assert crds.errors(obj) == [], obj["metadata"]["name"]


def _port_as_a_number(pod_monitor: dict) -> None:
    pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] = 8000


def _interval_in_words(pod_monitor: dict) -> None:
    pod_monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"


def _misspelt_field(pod_monitor: dict) -> None:
    pod_monitor["spec"]["podMetricEndpoints"] = pod_monitor["spec"].pop("podMetricsEndpoints")


def _rule_without_an_expression(rule: dict) -> None:
    del rule["spec"]["groups"][0]["rules"][0]["expr"]


def _group_twice(rule: dict) -> None:
    rule["spec"]["groups"].append(copy.deepcopy(rule["spec"]["groups"][0]))


# (the object broken, how, the one error its CRD schema gives)
BROKEN_MONITORING_OBJECTS: list[tuple[str, Callable[[dict], None], str]] = [
    ("PodMonitor", _port_as_a_number, "spec.podMetricsEndpoints.0.port: 8000 is not of type 'string'"),
    ("PodMonitor", _interval_in_words,
     "spec.podMetricsEndpoints.0.interval: '15 seconds' does not match"),
    ("PodMonitor", _misspelt_field,
     "spec: Additional properties are not allowed ('podMetricEndpoints' was unexpected)"),
    ("PrometheusRule", _rule_without_an_expression,
     "spec.groups.0.rules.0: 'expr' is a required property"),
    ("PrometheusRule", _group_twice, "spec.groups: duplicate entries in a list of type map"),
]


@pytest.mark.parametrize(
    ("kind", "break_it", "error"),
    BROKEN_MONITORING_OBJECTS,
    ids=[b.__name__.strip("_") for _, b, _ in BROKEN_MONITORING_OBJECTS],
)
def test_a_broken_monitoring_object_is_refused_at_its_field(
    kind: str, break_it: Callable[[dict], None], error: str
) -> None:
    obj = next(o for o in monitoring_objects() if o["kind"] == kind)
    break_it(obj)
    errors = CRDSchemas(PROMETHEUS_OPERATOR_CRDS).errors(obj)
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_monitoring_off_renders_no_monitoring_objects() -> None:
    kinds = {d["kind"] for d in render({"monitoring": {"enabled": False}, "dashboards": {"enabled": False}})}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"operator": {"replicas": -1}}, "/operator/replicas"),
        ({"operator": {"logLevel": "loud"}}, "/operator/logLevel"),
        ({"monitoring": {"enabled": "sometimes"}}, "/monitoring/enabled"),
        ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ],
)
def test_bad_values_fail_the_install_naming_the_field(values: dict, field: str) -> None:
    chart = helm.Chart.load(str(CHART))
    try:
        with pytest.raises(helm.HelmValuesError, match=f"at '{field}'"):
            chart.render(values, name="rel", namespace="llumnix", is_install=True)
        with pytest.raises(helm.HelmValuesError, match="additional properties 'typo' not allowed"):
            chart.render({"typo": 1}, name="rel", namespace="llumnix", is_install=True)
    finally:
        chart.close()


def test_operator_pod_is_restricted_and_takes_scheduling_and_pull_secrets() -> None:
    docs = render({
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {"affinity": {"nodeAffinity": {}}, "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "llumnix-operator"}}}]},
    })
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    validate(deployment)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "LLUMNIX_IMAGE_PULL_SECRETS", "value": "regcred"} in container["env"]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_notes_say_how_to_reach_the_service_and_the_dashboards() -> None:
    chart = helm.Chart.load(str(CHART))
    try:
        notes = chart.render({"dashboards": {"enabled": True}}, name="rel", namespace="llumnix")
    finally:
        chart.close()
    text = next(v for k, v in notes.items() if k.endswith("NOTES.txt"))
    assert "kubectl get llms" in text and "port-forward svc/NAME-router" in text
    assert "Llumnix / Service" in text and "grafana_dashboard=1" in text


def test_network_policy_lets_only_routers_peers_operator_and_prometheus_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = render({"networkPolicy": {
        "enabled": True,
        "prometheusNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    monkeypatch.setenv("LLUMNIX_NETWORK_POLICY", env["LLUMNIX_NETWORK_POLICY"])
    config = BuildConfig.from_env()
    settings = ServiceSettings("llama", "prod", validate_spec({"model": {"name": "llama"}}))
    policy = next(o for o in owned_objects(settings, config) if o["kind"] == "NetworkPolicy")
    validate(policy)
    same_service, operator, prometheus = policy["spec"]["ingress"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in same_service["from"]] == [
        "router", "engine"]
    namespace = operator["from"][0]["namespaceSelector"]["matchLabels"]
    assert namespace == {"kubernetes.io/metadata.name": "llumnix"}
    assert operator["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "llumnix-operator"
    assert prometheus == {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {}}],
        "ports": [{"port": "llumlet-http"}],
    }
    # the ports it names are the engine pod's
    containers = engine_pod(settings, config)["spec"]["containers"]
    pod_ports = {p["name"] for c in containers for p in c.get("ports", ())}
    assert {"llumlet-grpc", "llumlet-http"} <= pod_ports
    assert not any(o["kind"] == "NetworkPolicy" for o in owned_objects(settings, BuildConfig()))
