"""Create-or-patch for the objects an LLMService owns: create what is missing, patch what differs from
the desired manifest, leave alone what already matches (and what is made once: its token Secret).

Only the fields the desired manifest sets are compared and patched (a JSON merge patch of the desired
manifest), so what the API server defaults and what other writers add (annotations, labels of their
own, status) is never fought over. A field the operator set before and no longer sets is named by the
caller (`absent`): it is removed (null in the merge patch) if the live object still has it. Calls are
synchronous (the official client); the handlers run them in a thread."""

from __future__ import annotations

import copy
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kubernetes

MERGE_PATCH = "application/merge-patch+json"


class Outcome(enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class _Kind:
    api: type
    methods: str
    """Suffix of the client's methods: read_<methods>, create_<methods>, patch_<methods>."""
    create_only: bool = False
    """Made once and then left as it is (a Secret with a generated value: patching would rotate it)."""


_KINDS: dict[tuple[str, str], _Kind] = {
    ("v1", "Secret"): _Kind(kubernetes.client.CoreV1Api, "namespaced_secret", create_only=True),
    ("v1", "Service"): _Kind(kubernetes.client.CoreV1Api, "namespaced_service"),
    ("v1", "ServiceAccount"): _Kind(kubernetes.client.CoreV1Api, "namespaced_service_account"),
    ("apps/v1", "Deployment"): _Kind(kubernetes.client.AppsV1Api, "namespaced_deployment"),
    ("networking.k8s.io/v1", "NetworkPolicy"): _Kind(
        kubernetes.client.NetworkingV1Api, "namespaced_network_policy"
    ),
    ("policy/v1", "PodDisruptionBudget"): _Kind(
        kubernetes.client.PolicyV1Api, "namespaced_pod_disruption_budget"
    ),
    ("rbac.authorization.k8s.io/v1", "Role"): _Kind(
        kubernetes.client.RbacAuthorizationV1Api, "namespaced_role"
    ),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): _Kind(
        kubernetes.client.RbacAuthorizationV1Api, "namespaced_role_binding"
    ),
}


def covers(live: Any, desired: Any) -> bool:
    """Whether `live` already holds every field `desired` sets. Objects compare key by key (extra
    live keys are someone else's); lists compare item by item and must have the same length."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(covers(live.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(covers(a, b) for a, b in zip(live, desired, strict=True))
        )
    return live == desired


def value_at(obj: Any, path: Sequence[str]) -> Any:
    """The value at `path` (keys) inside `obj`; None where any step is missing."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def with_removals(manifest: dict[str, Any], absent: Sequence[Sequence[str]]) -> dict[str, Any]:
    """`manifest` as a JSON merge patch that also removes each path in `absent` (a null there)."""
    patch = copy.deepcopy(manifest)
    for path in absent:
        node = patch
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = None
    return patch


class Ensurer:
    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client

    def _api(self, manifest: dict[str, Any]) -> tuple[Any, _Kind]:
        key = (manifest["apiVersion"], manifest["kind"])
        if key not in _KINDS:
            raise ValueError(f"the operator does not manage {key[1]} ({key[0]}) objects")
        kind = _KINDS[key]
        return kind.api(self.api_client), kind

    def ensure(self, manifest: dict[str, Any], absent: Sequence[Sequence[str]] = ()) -> Outcome:
        """Create, patch or leave the object `manifest` describes. `absent`: paths of fields the manifest
        leaves out that the live object must not have either (fields the operator set before)."""
        api, kind = self._api(manifest)
        methods = kind.methods
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        try:
            live = getattr(api, f"read_{methods}")(name, namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            try:
                getattr(api, f"create_{methods}")(namespace, manifest)
            except kubernetes.client.ApiException as exc:
                if exc.status == 409 and kind.create_only:  # another operator replica made it first
                    return Outcome.UNCHANGED
                raise
            return Outcome.CREATED
        if kind.create_only:
            return Outcome.UNCHANGED
        live = self.api_client.sanitize_for_serialization(live)
        stale = [path for path in absent if value_at(live, path) is not None]
        if covers(live, manifest) and not stale:
            return Outcome.UNCHANGED
        patch = with_removals(manifest, stale)
        getattr(api, f"patch_{methods}")(name, namespace, patch, _content_type=MERGE_PATCH)
        return Outcome.PATCHED
