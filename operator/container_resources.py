"""Kubernetes `resources` of the containers the operator adds beside the engine (router, llumlet),
from the spec's `router.resources` / `llumlet.resources`: the CPU is requested (never limited, so a
burst of tokens is not throttled), the memory requested and limited alike."""

from __future__ import annotations

from typing import Any

from llumnix.service_spec import ContainerResources


def container_resources(resources: ContainerResources) -> dict[str, Any]:
    return {
        "requests": {"cpu": resources.cpu, "memory": resources.memory},
        "limits": {"memory": resources.memory},
    }
