"""Where the operator's pods are scheduled: the spec's `nodeSelector`, `tolerations`, `affinity` and
`topologySpreadConstraints` (engine pods: `spec.engine.resources`; router pods: `spec.router`), copied
into the pod spec as written. A field the spec does not set is left out of the pod spec, so pods and
Deployments built before these fields existed are built the same (same template hash, nothing to patch)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from llumnix.service_spec import PodPlacement

PLACEMENT_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints")
"""The pod spec fields PodPlacement sets, named as in the pod spec and in the LLMService spec."""


def pod_placement(placement: PodPlacement) -> dict[str, Any]:
    """The pod spec fields `placement` sets (copies), in PLACEMENT_FIELDS order; {} when none is set."""
    fields: dict[str, Any] = {
        "nodeSelector": dict(placement.node_selector),
        "tolerations": list(placement.tolerations),
        "affinity": dict(placement.affinity),
        "topologySpreadConstraints": list(placement.topology_spread_constraints),
    }
    return {key: copy.deepcopy(value) for key, value in fields.items() if value}


def dropped_placement(old: Mapping[str, Any] | None, placement: PodPlacement) -> list[str]:
    """The placement fields `old` (the same spec object before a change: `spec.router` or
    `spec.engine.resources` as written) set that `placement` no longer sets. A merge patch of a desired
    manifest leaves the fields it omits as they are, so the caller removes these explicitly; fields
    nobody in the spec ever set (another writer's) are left alone."""
    if not isinstance(old, Mapping):
        return []
    current = pod_placement(placement)
    return [field for field in PLACEMENT_FIELDS if old.get(field) and field not in current]
