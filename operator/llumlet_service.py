"""The headless Service of a service's llumlets: its DNS name resolves to the ready engine pods' IPs,
which is how the router finds them (`llumnix router --instances-dns`)."""

from __future__ import annotations

from typing import Any

from llumnix.service_spec import ServiceSettings
from llumnix_operator.naming import (
    ENGINE,
    LLUMLET_GRPC_PORT,
    LLUMLET_HTTP_PORT,
    labels,
    llumlets_service_name,
    selector,
)


def llumlets_dns_name(settings: ServiceSettings) -> str:
    return f"{llumlets_service_name(settings.name)}.{settings.namespace}.svc"


def llumlets_service(settings: ServiceSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": llumlets_service_name(settings.name),
            "namespace": settings.namespace,
            "labels": labels(settings.name, ENGINE),
        },
        "spec": {
            "clusterIP": "None",
            # Only ready llumlets are published: the router never dispatches to a loading engine.
            "publishNotReadyAddresses": False,
            "selector": selector(settings.name, ENGINE),
            "ports": [
                {"name": "grpc", "port": LLUMLET_GRPC_PORT, "targetPort": "llumlet-grpc"},
                {"name": "http", "port": LLUMLET_HTTP_PORT, "targetPort": "llumlet-http"},
            ],
        },
    }
