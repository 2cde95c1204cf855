"""The LLMService `.status` (schema: `llumnix_operator.crd.STATUS_SCHEMA`) from the control loop's
`ServiceStatus`: counts, the aggregate freeness the autoscaler acts on (and what it means in decode
steps), per-instance summary, the last scaling decision (with the aggregate
freeness it was taken at), and the Ready / Progressing / Degraded conditions with their reasons."""

from __future__ import annotations

import datetime
import math
from typing import Any

from llumnix.control.status import ServiceStatus, headroom
from llumnix_operator.naming import ENGINE, selector_string

TRANSITIONAL_PHASES = ("starting", "terminating")


def timestamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions_for(status: ServiceStatus) -> list[dict[str, str]]:
    """The three conditions (without transition times), each with the reason a user acts on."""
    serving, desired = status.serving, status.desired
    failed = [i.instance_id for i in status.instances if i.phase == "failed"]
    moving = [i for i in status.instances if i.phase in TRANSITIONAL_PHASES or i.draining]
    if serving == 0:
        ready = condition("Ready", False, "NoInstanceServing", f"0 of {desired} instances serve")
    elif serving >= desired:
        ready = condition("Ready", True, "AllInstancesServing", f"{serving} of {desired} instances serve")
    else:
        ready = condition("Ready", True, "PartiallyServing", f"{serving} of {desired} instances serve")
    if serving < desired:
        progressing = condition("Progressing", True, "ScalingUp", f"{serving} serving, {desired} desired")
    elif moving or len(status.instances) > desired:
        if any(i.draining for i in moving):
            reason = "Draining"
        elif any(i.phase == "starting" for i in moving):
            reason = "Replacing"
        else:
            reason = "ScalingDown"
        progressing = condition(
            "Progressing", True, reason, f"{len(moving)} instance(s) starting, draining or terminating"
        )
    else:
        progressing = condition("Progressing", False, "Stable", f"{desired} instance(s) serving")
    if failed:
        degraded = condition("Degraded", True, "InstanceFailed", "failed: " + ", ".join(sorted(failed)))
    else:
        degraded = condition("Degraded", False, "Healthy", "no failed instance")
    return [ready, progressing, degraded]


def invalid_spec_conditions(message: str) -> list[dict[str, str]]:
    """What the status says about a spec the operator cannot act on (the schema let it through)."""
    return [
        condition("Ready", False, "InvalidSpec", message),
        condition("Progressing", False, "InvalidSpec", message),
        condition("Degraded", True, "InvalidSpec", message),
    ]


def with_transition_times(
    conditions: list[dict[str, str]], previous: list[dict[str, Any]], now: float
) -> list[dict[str, Any]]:
    """Each condition keeps its previous lastTransitionTime unless its status changed."""
    before = {c.get("type"): c for c in previous}
    stamped = []
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
        stamped.append({**cond, "lastTransitionTime": old["lastTransitionTime"] if same else timestamp(now)})
    return stamped


def _finite(value: float | None) -> float | None:
    return round(value, 2) if value is not None and math.isfinite(value) else None


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def service_status(
    status: ServiceStatus,
    *,
    generation: int | None,
    previous: dict[str, Any],
    now: float,
    migrations_before: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The whole `.status` to write; `previous` is the status the object holds now. A restarted
    operator's loop counts from zero: `migrations_before` (the counts it found in the status) is added,
    and the last scaling decision is kept until the new loop makes one."""
    migrations = status.migrations
    before = migrations_before or {}
    result: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": len([i for i in status.instances if i.phase != "terminating"]),
        "selector": selector_string(status.name, ENGINE),
        "instances": {"ready": status.ready, "desired": status.desired},
        "aggregateFreeness": _finite(status.aggregate_freeness),
        "headroom": None if status.aggregate_freeness is None
        else headroom(status.aggregate_freeness, status.block_size, idle=status.idle),
        "migrations": {
            "completed": before.get("completed", 0) + migrations.get("committed", 0),
            "aborted": before.get("aborted", 0) + migrations.get("aborted", 0) + migrations.get("error", 0),
        },
        "instanceSummaries": [
            _drop_none(
                {
                    "name": i.instance_id,
                    "phase": i.phase,
                    "freeness": _finite(i.freeness),
                    "running": i.running,
                    "waiting": i.waiting,
                    "draining": i.draining,
                }
            )
            for i in sorted(status.instances, key=lambda i: i.instance_id)
        ],
        "conditions": with_transition_times(conditions_for(status), previous.get("conditions") or [], now),
    }
    decision = status.last_decision
    if decision is None and previous.get("lastScaling"):
        result["lastScaling"] = previous["lastScaling"]
    elif decision is not None:
        result["lastScaling"] = _drop_none(
            {
                "time": timestamp(decision.time),
                "action": decision.kind,
                "instance": decision.instance_id,
                "reason": decision.reason,
                "aggregateFreeness": _finite(decision.aggregate_freeness),
            }
        )
    return _drop_none(result)


LOAD_FIELDS = ("freeness", "running", "waiting")
"""Per-instance figures that move with every request (written at a bounded rate)."""
SERVICE_LOAD_FIELDS = ("aggregateFreeness", "headroom")
"""The same for the service as a whole."""


def _comparable(status: dict[str, Any], with_load: bool) -> dict[str, Any]:
    conditions = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
    ]
    result = {**status, "conditions": conditions}
    if not with_load:
        for key in SERVICE_LOAD_FIELDS:
            result.pop(key, None)
        result["instanceSummaries"] = [
            {k: v for k, v in i.items() if k not in LOAD_FIELDS}
            for i in status.get("instanceSummaries") or []
        ]
    return result


def status_changed(new: dict[str, Any], old: dict[str, Any], *, with_load: bool = True) -> bool:
    """Whether writing `new` would change what `old` says (transition times aside; load figures
    aside too unless `with_load`)."""
    return _comparable(new, with_load) != _comparable(old, with_load)
