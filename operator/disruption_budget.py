"""The PodDisruptionBudget of the engine pods: node drains evict one engine at a time, so each
evicted pod's preStop hook can migrate its requests to the others. (The operator deletes pods
itself, after draining them, and is not subject to it.)"""

from __future__ import annotations

from typing import Any

from llumnix.service_spec import ServiceSettings
from llumnix_operator.naming import ENGINE, labels, selector


def engine_disruption_budget(settings: ServiceSettings) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": f"{settings.name}-engine",
            "namespace": settings.namespace,
            "labels": labels(settings.name, ENGINE),
        },
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(settings.name, ENGINE)}},
    }
