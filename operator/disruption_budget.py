"""PodDisruptionBudgets of an LLMService's pods: node drains evict one engine at a time, so each
evicted pod's preStop hook can migrate its requests to the others, and one router at a time, so a
service with several router replicas keeps answering. (The operator deletes engine pods itself, after
draining them, and is not subject to it.)"""

from __future__ import annotations

from typing import Any

from llumnix.service_spec import ServiceSettings
from llumnix_operator.naming import labels, selector


def disruption_budget(settings: ServiceSettings, component: str) -> dict[str, Any]:
    """`component`: ENGINE or ROUTER (`llumnix_operator.naming`)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": f"{settings.name}-{component}",
            "namespace": settings.namespace,
            "labels": labels(settings.name, component),
        },
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(settings.name, component)}},
    }
