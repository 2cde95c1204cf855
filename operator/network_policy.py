"""The opt-in NetworkPolicy of an LLMService's engine pods: only its routers, its peer engines (the
migration protocol and the KV channel), the operator (load streams, drains, migrations) and
Prometheus (the llumlet's /metrics) may reach them. Kubelet probes come from the node and are not
subject to it. On by the chart's `networkPolicy.enabled`, which hands the operator its own namespace
and labels and Prometheus's selectors (`LLUMNIX_NETWORK_POLICY`, JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llumnix.service_spec import ServiceSettings
from llumnix_operator.naming import ENGINE, ROUTER, labels, selector

NETWORK_POLICY_ENV = "LLUMNIX_NETWORK_POLICY"


@dataclass(frozen=True)
class NetworkPolicyConfig:
    operator_namespace: str
    operator_pod_labels: dict[str, str]
    prometheus_namespace_selector: dict[str, Any] = field(default_factory=dict)
    """Label selector of Prometheus's namespace ({}: every namespace)."""
    prometheus_pod_selector: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> NetworkPolicyConfig:
        data = json.loads(text)
        prometheus = data.get("prometheus") or {}
        return cls(
            operator_namespace=data["operatorNamespace"],
            operator_pod_labels=dict(data["operatorPodLabels"]),
            prometheus_namespace_selector=dict(prometheus.get("namespaceSelector") or {}),
            prometheus_pod_selector=dict(prometheus.get("podSelector") or {}),
        )


def engine_network_policy(settings: ServiceSettings, config: NetworkPolicyConfig) -> dict[str, Any]:
    name = settings.name
    same_service = [
        {"podSelector": {"matchLabels": selector(name, ROUTER)}},
        {"podSelector": {"matchLabels": selector(name, ENGINE)}},
    ]
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}},
        "podSelector": {"matchLabels": dict(config.operator_pod_labels)},
    }
    prometheus = {
        "namespaceSelector": dict(config.prometheus_namespace_selector),
        "podSelector": dict(config.prometheus_pod_selector),
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": f"{name}-engine",
            "namespace": settings.namespace,
            "labels": labels(name, ENGINE),
        },
        "spec": {
            "podSelector": {"matchLabels": selector(name, ENGINE)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": same_service},  # every port: llumlet gRPC and HTTP, the engines' KV channel
                {"from": [operator], "ports": [{"port": "llumlet-grpc"}, {"port": "llumlet-http"}]},
                {"from": [prometheus], "ports": [{"port": "llumlet-http"}]},
            ],
        },
    }
