"""Names, labels and ports shared by every object the operator builds for one LLMService.

Labels follow the Kubernetes recommended set (app.kubernetes.io/*); `llumnix.io/service` names the
LLMService and is what selectors use, so two services in one namespace never select each other's pods.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SERVICE_LABEL = "llumnix.io/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
TEMPLATE_HASH_ANNOTATION = "llumnix.io/template-hash"
MANAGED_BY = "llumnix-operator"

ENGINE = "engine"
ROUTER = "router"

ENGINE_PORT = 8000
LLUMLET_HTTP_PORT = 8100
LLUMLET_GRPC_PORT = 50051


def labels(service: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"llumnix-{component}",
        "app.kubernetes.io/instance": service,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": "llumnix",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        SERVICE_LABEL: service,
    }


def selector(service: str, component: str) -> dict[str, str]:
    return {SERVICE_LABEL: service, COMPONENT_LABEL: component}


def selector_string(service: str, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(service, component).items())


def llumlets_service_name(service: str) -> str:
    """The headless Service whose A records are the ready llumlets (the router resolves it)."""
    return f"{service}-llumlets"


def router_name(service: str) -> str:
    return f"{service}-router"


def engine_pod_prefix(service: str) -> str:
    return f"{service}-engine-"


def token_secret_name(service: str) -> str:
    """The Secret holding the service token its llumlets require (llumnix/service_token.py)."""
    return f"{service}-llumlet-token"


def service_account_name(service: str) -> str:
    return f"{service}-llumnix"


def template_hash(template: Any) -> str:
    """A short digest of a pod template (canonical JSON): equal templates, equal hashes."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """A controller reference to the LLMService `owner` (its body): Kubernetes deletes what it owns."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
