"""The service token of an LLMService (llumnix/service_token.py) lives in a Secret the operator creates
once, owned by the LLMService: every llumlet requires it, the routers and the operator's control loop
present it. Pods get it as an environment variable from the Secret, never in their spec or argv.

Level-based and idempotent: an existing Secret is never rewritten (a restart or a second operator
replica must not rotate the token under running pods); deleting it rotates the token on the next
reconcile, and pods started before keep the old one until they are replaced."""

from __future__ import annotations

import base64
from typing import Any

import kubernetes

from llumnix.service_spec import ServiceSettings
from llumnix.service_token import SECRET_KEY, SERVICE_TOKEN_ENV, ServiceToken
from llumnix_operator.naming import ENGINE, labels, token_secret_name


def token_secret(settings: ServiceSettings, token: ServiceToken) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(settings.name),
            "namespace": settings.namespace,
            "labels": labels(settings.name, ENGINE),
        },
        "type": "Opaque",
        # `data`, not `stringData`: what is read back is what was written, on any API server.
        "data": {SECRET_KEY: base64.b64encode(token.value.encode()).decode()},
    }


def token_env(service: str) -> dict[str, Any]:
    """The container env entry that holds the service's token."""
    return {"name": SERVICE_TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": token_secret_name(service), "key": SECRET_KEY}}}


def read_token(api_client: kubernetes.client.ApiClient, service: str, namespace: str) -> ServiceToken | None:
    """The service's token; None while its Secret does not exist (the create handler makes it)."""
    try:
        secret = kubernetes.client.CoreV1Api(api_client).read_namespaced_secret(
            token_secret_name(service), namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    encoded = (secret.data or {}).get(SECRET_KEY)
    if not encoded:
        raise ValueError(f"Secret {token_secret_name(service)} has no {SECRET_KEY!r} key: delete it and "
                         "the operator makes a new one")
    return ServiceToken(base64.b64decode(encoded).decode())
