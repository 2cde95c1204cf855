"""The router of an LLMService: a Deployment running `llumnix router` over the llumlets' headless
Service, and the Service clients connect to."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from llumnix.service_spec import ServiceSettings
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.container_resources import container_resources
from llumnix_operator.engine_pod import model_location, model_volume
from llumnix_operator.llumlet_service import llumlets_dns_name
from llumnix_operator.naming import (
    LLUMLET_GRPC_PORT,
    ROUTER,
    labels,
    router_name,
    selector,
    service_account_name,
)
from llumnix_operator.placement import dropped_placement, pod_placement
from llumnix_operator.pod_security import (
    CONTAINER_SECURITY_CONTEXT,
    POD_SECURITY_CONTEXT,
    WRITABLE_ENV,
    WRITABLE_MOUNTS,
    WRITABLE_VOLUMES,
)
from llumnix_operator.service_token_secret import token_env

API_KEYS_DIR = "/etc/llumnix/api-keys"


def router_args(settings: ServiceSettings) -> list[str]:
    spec = settings.spec
    dispatch, priorities = spec.dispatch, spec.priorities
    args = [
        "router",
        "--host",
        "0.0.0.0",
        "--model",
        spec.model.name,
        "--instances-dns",
        f"{llumlets_dns_name(settings)}:{LLUMLET_GRPC_PORT}",
        "--port",
        str(spec.router.port),
        "--dispatch-policy",
        dispatch.policy,
        "--busy-freeness",
        str(dispatch.busy_freeness),
        "--top-k",
        str(dispatch.top_k),
        "--prefix-weight",
        str(dispatch.prefix_weight),
        "--high-priority-target-tokens",
        str(priorities.target_load_tokens),
        "--priority-header",
        priorities.header,
    ]
    if spec.router.api_key_secret:
        args += ["--api-keys-file", f"{API_KEYS_DIR}/keys"]
    if tokenizes_prompts(settings):
        args += ["--tokenizer", model_location(spec.model)]
    return args


def tokenizes_prompts(settings: ServiceSettings) -> bool:
    """Whether the router reads the model's tokenizer from the model claim (mounted in its pod too),
    so that prefix-aware dispatch looks text and chat prompts up, not only token ids. A model from a
    hub id has no folder the router could read; the sim engine has no model at all."""
    spec = settings.spec
    return bool(spec.model.source.pvc) and spec.engine.runtime != "sim" and spec.dispatch.prefix_weight > 0


def router_deployment(settings: ServiceSettings, config: BuildConfig) -> dict[str, Any]:
    router, name = settings.spec.router, settings.name
    port = router.port
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3}
    container: dict[str, Any] = {
        "name": "router",
        "image": config.image,
        "command": ["llumnix"],
        "args": router_args(settings),
        "ports": [{"name": "http", "containerPort": port}],
        "resources": container_resources(router.resources),
        "env": [*copy.deepcopy(WRITABLE_ENV), token_env(name)],  # presented to every llumlet
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": copy.deepcopy(WRITABLE_MOUNTS),
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": service_account_name(name),
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": copy.deepcopy(WRITABLE_VOLUMES),
    }
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = config.pull_secrets()
    pod_spec.update(pod_placement(router.placement))  # only the fields the spec sets; no default spread
    model = model_volume(settings.spec.model.source)
    if model is not None and tokenizes_prompts(settings):
        pod_spec["volumes"].append(model[0])
        container["volumeMounts"].append(model[1])
    secret = router.api_key_secret
    if secret:
        container["volumeMounts"].append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        pod_spec["volumes"].append({"name": "api-keys", "secret": {"secretName": secret}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": router_name(name),
            "namespace": settings.namespace,
            "labels": labels(name, ROUTER),
        },
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector(name, ROUTER)},
            "template": {"metadata": {"labels": labels(name, ROUTER)}, "spec": pod_spec},
        },
    }


def router_fields_to_clear(
    settings: ServiceSettings, old_spec: Mapping[str, Any] | None
) -> list[tuple[str, ...]]:
    """Paths in the router Deployment of the placement fields the previous spec `old_spec` set under
    `spec.router` and `settings` no longer sets: the ensurer removes them from the live Deployment
    (its merge patch of `router_deployment` would leave them in place)."""
    old_router = old_spec.get("router") if isinstance(old_spec, Mapping) else None
    dropped = dropped_placement(old_router, settings.spec.router.placement)
    return [("spec", "template", "spec", field) for field in dropped]


def router_service(settings: ServiceSettings) -> dict[str, Any]:
    name, router = settings.name, settings.spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": router_name(name),
            "namespace": settings.namespace,
            "labels": labels(name, ROUTER),
        },
        "spec": {
            "type": router.service_type,
            "selector": selector(name, ROUTER),
            "ports": [{"name": "http", "port": router.port, "targetPort": "http"}],
        },
    }


def router_urls(pods: list[dict[str, Any]], port: int) -> list[str]:
    """Pure: the base URLs of the running router pods (as the API serves them), where the control loop
    reads the requests each holds (every replica holds its own)."""
    urls = []
    for pod in pods:
        status = pod.get("status") or {}
        host = status.get("podIP")
        if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running" or not host:
            continue
        urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return sorted(urls)
