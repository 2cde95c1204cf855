"""What the operator's per-LLMService daemon does: run the shared `ControlLoop` over the service's
engine pods, feed it spec changes (including `/scale`), roll pods whose template is stale, write
`.status` when it changes and turn the loop's events into Kubernetes events.

The loop owns the instance count, pairing, autoscaling, draining and replacement of failed pods; this
class only connects it to the custom resource."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes

from llumnix.control.backend import InstancePhase
from llumnix.control.fleet import UnknownInstance
from llumnix.control.loop import ControlLoop
from llumnix.control.router_queues import RouterQueues
from llumnix.control.status import ControlEvent
from llumnix.llumlet_client import LlumletConnection
from llumnix.service_spec import API_GROUP, API_VERSION, PLURAL, ServiceSettings, SpecError, validate_spec
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.engine_pod import engine_pod, engine_pod_template
from llumnix_operator.metrics import OperatorMetrics
from llumnix_operator.naming import ROUTER, selector_string, service_account_name, template_hash
from llumnix_operator.pod_backend import PodBackend
from llumnix_operator.router import router_urls
from llumnix_operator.service_token_secret import read_token
from llumnix_operator.status import (
    invalid_spec_conditions,
    service_status,
    status_changed,
    with_transition_times,
)

logger = logging.getLogger("llumnix.operator")


class ServiceRunner:
    """One LLMService. `body` is kopf's live view of the object (it follows every change)."""

    def __init__(
        self,
        body: Mapping[str, Any],
        api_client: kubernetes.client.ApiClient,
        config: BuildConfig,
        on_event: Callable[[ControlEvent], None],
        clock: Callable[[], float] = time.time,
        load_refresh_s: float = 10.0,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        """`metrics`: where this service's figures and events are counted (the operator passes the
        process's; default: a registry of its own)."""
        self.body = body
        self.api_client = api_client
        self.config = config
        self.clock = clock
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.settings: ServiceSettings | None = None
        self.spec_error: str | None = None
        self._seen_spec: dict[str, Any] | None = None
        self.written_status: dict[str, Any] = _plain(body.get("status") or {})
        self.migrations_before: dict[str, int] = dict(self.written_status.get("migrations") or {})
        self.backend = PodBackend(
            api_client, self._owner(), self._require_settings, lambda s: engine_pod(s, config)
        )
        self.metrics = metrics or OperatorMetrics()
        self._forward_event = on_event
        self.loop: ControlLoop | None = None
        self.load_refresh_s = load_refresh_s
        self._last_write = -math.inf

    def on_event(self, event: ControlEvent) -> None:
        self.metrics.count_event(self.namespace, self.name, event.reason)
        self._forward_event(event)

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    def _owner(self) -> dict[str, Any]:
        meta = self.body["metadata"]
        return {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": self.body.get("kind", "LLMService"),
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
        }

    def _require_settings(self) -> ServiceSettings:
        assert self.settings is not None, "the loop runs only with valid settings"
        return self.settings

    def read_spec(self) -> None:
        """Validate the current spec; a valid change reaches the loop, an invalid one keeps the last
        valid settings in force and is reported in the conditions."""
        spec = _plain(self.body.get("spec") or {})
        if spec == self._seen_spec:
            return
        self._seen_spec = spec
        try:
            settings = ServiceSettings(self.name, self.namespace, validate_spec(spec))
        except SpecError as exc:
            self.spec_error = str(exc)
            logger.warning("invalid spec", extra={"error": self.spec_error})
            return
        self.spec_error = None
        self.settings = settings
        if self.loop is not None:
            self.loop.update_settings(settings)

    def current_template_hash(self) -> str:
        return template_hash(engine_pod_template(self._require_settings(), self.config))

    async def roll_one(self) -> str | None:
        """Rolling replacement: when no instance is starting or draining, drain one READY instance
        created from an older template (the loop starts its successor at once and releases it once
        its requests migrated away). Returns the instance chosen."""
        loop = self.loop
        if loop is None or loop.draining:
            return None
        if any(i.phase is InstancePhase.STARTING for i in loop.instances.values()):
            return None
        current = self.current_template_hash()
        stale = sorted(
            i.instance_id
            for i in loop.instances.values()
            if i.phase is InstancePhase.READY and i.template_hash and i.template_hash != current
        )
        if not stale:
            return None
        try:
            await loop.drain(stale[0])
        except UnknownInstance:
            return None
        self.on_event(
            ControlEvent(
                "Normal", "RollingUpdate", "engine template changed; draining it for replacement", stale[0]
            )
        )
        return stale[0]

    def desired_status(self) -> dict[str, Any]:
        previous = self.written_status
        generation = self.body["metadata"].get("generation")
        if self.loop is None or self.spec_error is not None:
            message = f"invalid spec: {self.spec_error}" if self.spec_error else "waiting for a valid spec"
            conditions = with_transition_times(
                invalid_spec_conditions(message), previous.get("conditions") or [], self.clock()
            )
            return {**previous, "observedGeneration": generation, "conditions": conditions}
        return service_status(
            self.loop.status(),
            generation=generation,
            previous=previous,
            now=self.clock(),
            migrations_before=self.migrations_before,
        )

    def _write_status(self, status: dict[str, Any]) -> None:
        # A merge patch removes a key only when it is sent as null.
        removed = {key: None for key in self.written_status if key not in status}
        self.custom.patch_namespaced_custom_object_status(
            API_GROUP,
            API_VERSION,
            self.namespace,
            PLURAL,
            self.name,
            {"status": {**removed, **status}},
            _content_type="application/merge-patch+json",
        )

    def _write_replicas(self, replicas: int) -> None:
        self.custom.patch_namespaced_custom_object(
            API_GROUP,
            API_VERSION,
            self.namespace,
            PLURAL,
            self.name,
            {"spec": {"replicas": replicas}},
            _content_type="application/merge-patch+json",
        )

    async def sync_status(self) -> bool:
        """Write `.status` if it changed; True when written."""
        if self.loop is not None and not self.backend.listed:
            return False  # the loop has not looked yet: it would report no instances
        status = self.desired_status()
        # State changes (conditions, counts, phases, decisions) are written at once; load figures that
        # move with every request at most every `load_refresh_s`, to spare the API server.
        load_due = time.monotonic() - self._last_write >= self.load_refresh_s
        if not status_changed(status, self.written_status, with_load=load_due):
            return False
        await asyncio.to_thread(self._write_status, status)
        self.written_status = status
        self._last_write = time.monotonic()
        return True

    async def publish_autoscaled_count(self) -> None:
        """With built-in autoscaling on, the loop's count is written to spec.replicas (the /scale
        subresource, so `kubectl get --subresource=scale` and HPA see it)."""
        if self.loop is None or self.settings is None or not self.settings.spec.autoscaling.enabled:
            return
        if self.loop.target is None:
            return
        desired = self.loop.desired
        if (self.body.get("spec") or {}).get("replicas") != desired:
            await asyncio.to_thread(self._write_replicas, desired)

    def _service_account_exists(self) -> bool:
        try:
            kubernetes.client.CoreV1Api(self.api_client).read_namespaced_service_account(
                service_account_name(self.name), self.namespace
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def _router_urls(self) -> list[str]:
        def listed() -> list[str]:
            settings = self._require_settings()
            pods = kubernetes.client.CoreV1Api(self.api_client).list_namespaced_pod(
                self.namespace, label_selector=selector_string(settings.name, ROUTER))
            raw = [self.api_client.sanitize_for_serialization(p) for p in pods.items]
            return router_urls(raw, settings.spec.router.port)

        return await asyncio.to_thread(listed)

    async def tick(self) -> None:
        self.read_spec()
        # Pods naming a missing service account are refused: wait for the create handler's objects.
        # The llumlets require the token from the same handler's Secret.
        if (
            self.loop is None
            and self.settings is not None
            and await asyncio.to_thread(self._service_account_exists)
            and (token := await asyncio.to_thread(read_token, self.api_client, self.name, self.namespace))
        ):
            self.loop = ControlLoop(
                self.settings,
                self.backend,
                on_event=self.on_event,
                clock=self.clock,
                connect=functools.partial(LlumletConnection, token=token),
                router_queues=RouterQueues(self._router_urls, token),
                drain_timeout_s=self.config.drain_timeout_s,
            )
        if self.loop is not None and self.spec_error is None:
            await self.roll_one()
            await self.publish_autoscaled_count()
        await self.sync_status()
        valid = self.loop is not None and self.spec_error is None
        self.metrics.publish(self.namespace, self.name, self.loop.status() if valid else None)

    async def run(self, stopped: Callable[[], bool], interval_s: float = 1.0) -> None:
        """Until `stopped()`; the loop runs beside the ticks and is cancelled at the end."""
        loop_task: asyncio.Task[None] | None = None
        try:
            while not stopped():
                started = time.perf_counter()
                try:
                    await self.tick()
                except Exception:  # an API outage or a rejected write: retried next tick, never fatal
                    self.metrics.errors.labels("tick").inc()
                    logger.exception("operator tick failed; retrying")
                self.metrics.tick_seconds.observe(time.perf_counter() - started)
                if loop_task is None and self.loop is not None:
                    loop_task = asyncio.create_task(self.loop.run(), name=f"control-loop {self.name}")
                await asyncio.sleep(interval_s)
        finally:
            self.metrics.forget(self.namespace, self.name)
            if loop_task is not None:
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
            await self.backend.close()


def _plain(value: Any) -> Any:
    """A deep copy of kopf's read-only views as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
