"""The operator's instance backend: an instance is an engine pod owned by the LLMService. The control
loop starts (creates), stops (deletes, after it drained the instance) and watches them through this.

Phases come from the pod: being deleted -> TERMINATING; failed, or a container that cannot start ->
FAILED; running and Ready -> READY (its llumlet answers at podIP:50051); otherwise STARTING."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from typing import Any

import kubernetes

from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.service_spec import ServiceSettings
from llumnix_operator.naming import (
    ENGINE,
    LLUMLET_GRPC_PORT,
    TEMPLATE_HASH_ANNOTATION,
    owner_reference,
    selector,
    selector_string,
)

# Waiting reasons after which a container will not start without a change to the pod or the node.
FATAL_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


def _seconds(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def instance_from_pod(pod: dict[str, Any]) -> InstanceInfo:
    """Pure: a pod (as the API serves it, camelCase) -> the instance the control loop sees."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    address = f"{ip}:{LLUMLET_GRPC_PORT}" if ip else None
    phase, message = InstancePhase.STARTING, status.get("message") or ""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    waiting = [
        (cs.get("name"), (cs.get("state") or {}).get("waiting") or {})
        for cs in status.get("containerStatuses") or []
    ]
    fatal = [(name, w) for name, w in waiting if w.get("reason") in FATAL_WAITING_REASONS]
    if meta.get("deletionTimestamp"):
        phase = InstancePhase.TERMINATING
    elif status.get("phase") in ("Failed", "Succeeded"):
        phase, message = InstancePhase.FAILED, message or f"pod {status['phase'].lower()}"
    elif fatal:
        name, w = fatal[0]
        phase, message = (
            InstancePhase.FAILED,
            f"container {name}: {w['reason']} {w.get('message', '')}".strip(),
        )
    elif status.get("phase") == "Running" and ready and address:
        phase = InstancePhase.READY
    return InstanceInfo(
        instance_id=meta["name"],
        phase=phase,
        address=address,
        created_at=_seconds(meta.get("creationTimestamp")),
        template_hash=(meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION, ""),
        message=message,
    )


def owned_by(pod: dict[str, Any], settings: ServiceSettings, owner_uid: str) -> bool:
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    return all(labels.get(k) == v for k, v in selector(settings.name, ENGINE).items()) and any(
        ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or []
    )


class PodBackend(InstanceBackend):
    """Engine pods of one LLMService. `pod_factory` builds a new pod from the current settings (the
    daemon swaps settings on spec changes, so new pods follow the new template)."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        owner: dict[str, Any],
        settings: Callable[[], ServiceSettings],
        pod_factory: Callable[[ServiceSettings], dict],
    ) -> None:
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.api_client = api_client
        self.owner = owner
        self.settings = settings
        self.pod_factory = pod_factory
        self.listed = False
        """Whether the pods were listed once (before that, the loop knows of no instance)."""

    @property
    def namespace(self) -> str:
        return self.owner["metadata"]["namespace"]

    def _list(self) -> list[InstanceInfo]:
        settings = self.settings()
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=selector_string(settings.name, ENGINE)
        )
        raw = [self.api_client.sanitize_for_serialization(p) for p in pods.items]
        uid = self.owner["metadata"]["uid"]
        return [instance_from_pod(p) for p in raw if owned_by(p, settings, uid)]

    def _create(self) -> InstanceInfo:
        pod = self.pod_factory(self.settings())
        pod["metadata"]["ownerReferences"] = [owner_reference(self.owner)]
        created = self.core.create_namespaced_pod(self.namespace, pod)
        return instance_from_pod(self.api_client.sanitize_for_serialization(created))

    def _delete(self, instance_id: str) -> None:
        try:
            self.core.delete_namespaced_pod(instance_id, self.namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise

    async def list_instances(self) -> list[InstanceInfo]:
        instances = await asyncio.to_thread(self._list)
        self.listed = True
        return instances

    async def start_instance(self) -> InstanceInfo:
        return await asyncio.to_thread(self._create)

    async def stop_instance(self, instance_id: str) -> None:
        await asyncio.to_thread(self._delete, instance_id)

    async def close(self) -> None:
        """The pods outlive the operator (a restarted operator adopts them): nothing to release."""
