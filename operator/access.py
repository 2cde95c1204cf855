"""The identity of a service's pods. Engines, llumlets and routers never call the Kubernetes API (the
router finds llumlets through DNS), so their ServiceAccount carries no token and is bound to a Role
that grants nothing beyond reading their own LLMService: the least a workload identity can hold."""

from __future__ import annotations

from typing import Any

from llumnix.service_spec import API_GROUP, PLURAL, ServiceSettings
from llumnix_operator.naming import ENGINE, labels, service_account_name


def service_account(settings: ServiceSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": service_account_name(settings.name),
            "namespace": settings.namespace,
            "labels": labels(settings.name, ENGINE),
        },
        "automountServiceAccountToken": False,
    }


def role(settings: ServiceSettings) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": service_account_name(settings.name),
            "namespace": settings.namespace,
            "labels": labels(settings.name, ENGINE),
        },
        "rules": [
            {
                "apiGroups": [API_GROUP],
                "resources": [PLURAL],
                "resourceNames": [settings.name],
                "verbs": ["get"],
            }
        ],
    }


def role_binding(settings: ServiceSettings) -> dict[str, Any]:
    name = service_account_name(settings.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": labels(settings.name, ENGINE)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": settings.namespace}],
    }
