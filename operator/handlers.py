"""The kopf handlers (thin): creating, resuming or changing an LLMService ensures the objects it owns;
a daemon per LLMService runs its control loop (`ServiceRunner`). Loaded by `llumnix operator`."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
import kubernetes

from llumnix.control.status import ControlEvent
from llumnix.service_spec import API_GROUP, API_VERSION, PLURAL, ServiceSettings, SpecError, validate_spec
from llumnix.service_token import ServiceToken
from llumnix_operator.access import role, role_binding, service_account
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.disruption_budget import disruption_budget
from llumnix_operator.ensure import Ensurer, Outcome
from llumnix_operator.llumlet_service import llumlets_service
from llumnix_operator.logs import service_context
from llumnix_operator.metrics import OPERATOR_METRICS
from llumnix_operator.naming import ENGINE, ROUTER, owner_reference
from llumnix_operator.network_policy import engine_network_policy
from llumnix_operator.router import router_deployment, router_fields_to_clear, router_service
from llumnix_operator.service_runner import ServiceRunner
from llumnix_operator.service_token_secret import token_secret

logger = logging.getLogger("llumnix.operator")


@functools.cache
def api_client() -> kubernetes.client.ApiClient:
    """In a pod: its service account; elsewhere: the current kubeconfig context."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def owned_objects(settings: ServiceSettings, config: BuildConfig) -> list[dict[str, Any]]:
    """Everything an LLMService owns besides its engine pods (the control loop creates those)."""
    objects = [
        token_secret(settings, ServiceToken.generate()),  # used only if the Secret does not exist yet
        service_account(settings),
        role(settings),
        role_binding(settings),
        llumlets_service(settings),
        router_deployment(settings, config),
        router_service(settings),
        disruption_budget(settings, ENGINE),
        disruption_budget(settings, ROUTER),
    ]
    if config.network_policy is not None:
        objects.append(engine_network_policy(settings, config.network_policy))
    return objects


def ensure_owned(
    settings: ServiceSettings,
    owner: dict[str, Any],
    config: BuildConfig,
    old_spec: Mapping[str, Any] | None = None,
) -> list[tuple[str, Outcome]]:
    """Create or patch every owned object; `old_spec` (the spec before this change, if it is one) names
    the router placement fields to remove from its Deployment."""
    ensurer = Ensurer(api_client())
    router_clear = router_fields_to_clear(settings, old_spec)
    results = []
    for manifest in owned_objects(settings, config):
        manifest["metadata"]["ownerReferences"] = [owner_reference(owner)]
        absent = router_clear if manifest["kind"] == "Deployment" else []  # the router is the one Deployment
        results.append(
            (f"{manifest['kind']}/{manifest['metadata']['name']}", ensurer.ensure(manifest, absent))
        )
    return results


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="llumnix.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="llumnix.io")


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    name: str,
    namespace: str,
    logger: logging.Logger,
    old: Any = None,
    **_: Any,
) -> None:
    """`old`: on a spec change, the spec before it (kopf scopes it to `field`); None on create/resume."""
    try:
        settings = ServiceSettings(name, namespace, validate_spec(dict(spec)))
    except SpecError as exc:
        # The schema let it through; the daemon reports it in the conditions. Retrying cannot help.
        OPERATOR_METRICS.reconciles.labels("invalid_spec").inc()
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        return
    started = time.perf_counter()
    try:
        old_spec = old if isinstance(old, Mapping) else None
        config = BuildConfig.from_env()
        results = await asyncio.to_thread(ensure_owned, settings, dict(body), config, old_spec)
    except Exception:
        OPERATOR_METRICS.reconciles.labels("error").inc()
        OPERATOR_METRICS.errors.labels("reconcile").inc()
        raise  # kopf retries with backoff
    finally:
        OPERATOR_METRICS.reconcile_seconds.observe(time.perf_counter() - started)
    changed = [f"{what} {outcome.value}" for what, outcome in results if outcome is not Outcome.UNCHANGED]
    OPERATOR_METRICS.reconciles.labels("changed" if changed else "unchanged").inc()
    if changed:
        logger.info("reconciled: " + ", ".join(changed))


def _post(body: kopf.Body, event: ControlEvent) -> None:
    message = f"{event.instance_id}: {event.message}" if event.instance_id else event.message
    kopf.event(body, type=event.kind, reason=event.reason, message=message)


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=15.0)
async def control(
    body: kopf.Body, name: str, namespace: str, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    runner = ServiceRunner(
        body,
        api_client(),
        BuildConfig.from_env(),
        on_event=lambda e: _post(body, e),
        metrics=OPERATOR_METRICS,
    )
    with service_context(namespace, name):  # the control loop's log lines name the LLMService
        await runner.run(lambda: bool(stopped))
