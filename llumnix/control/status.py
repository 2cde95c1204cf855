"""What the control loop reports: its events (the operator turns them into Kubernetes events) and a
status snapshot (local mode prints it, the admin API serves it, the operator writes it to the CR)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ControlEvent:
    kind: str
    """"Normal" or "Warning" (the Kubernetes event types)."""
    reason: str
    """CamelCase, e.g. ScaledUp, Draining, Released, InstanceFailed, DrainTimeout."""
    message: str
    instance_id: str | None = None


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    instance_id: str
    phase: str
    address: str | None
    freeness: float | None
    """None until a load arrived; -inf while draining."""
    running: int = 0
    waiting: int = 0
    draining: bool = False
    message: str = ""
    block_size: int | None = None
    """Tokens per KV block (from the load; None until a load arrived)."""

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    kind: str
    """scale-up, drain, cancel-drain, release, replace or none."""
    reason: str
    time: float
    instance_id: str | None = None
    aggregate_freeness: float | None = None
    """The service's aggregate freeness the decision was taken at (None: no load yet)."""


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    name: str
    desired: int
    instances: tuple[InstanceStatus, ...]
    aggregate_freeness: float | None
    """Freeness of the READY instances seen as one, draining ones aside (None: no load yet)."""
    migrations: dict[str, int] = field(default_factory=dict)
    """Outcome name (committed, refused, aborted, ..., error, unsupported) -> count."""
    scale_ups: int = 0
    drains: int = 0
    releases: int = 0
    replacements: int = 0
    last_decision: ScalingDecision | None = None

    @property
    def ready(self) -> int:
        return sum(1 for i in self.instances if i.phase == "ready")

    @property
    def serving(self) -> int:
        return sum(1 for i in self.instances if i.phase == "ready" and not i.draining)

    @property
    def idle(self) -> bool:
        """No request runs or waits on a serving instance."""
        return all(i.idle for i in self.instances if i.phase == "ready" and not i.draining)

    @property
    def block_size(self) -> int | None:
        """The service's KV block size (one model, one block size), from the first load seen."""
        return next((i.block_size for i in self.instances if i.block_size), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict: infinite freeness (draining) becomes null."""
        data = asdict(self)
        data["ready"] = self.ready
        data["idle"] = self.idle
        data["block_size"] = self.block_size
        for instance, row in zip(self.instances, data["instances"], strict=True):
            row["idle"] = instance.idle
            if instance.freeness is not None and not math.isfinite(instance.freeness):
                row["freeness"] = None
        return data


FREENESS_MEANING = ("freeness = free KV blocks per batched request; x block size = decode steps each "
                    "running request can still take before the KV cache is full")


def headroom(freeness: float | None, block_size: int | None, *, idle: bool, draining: bool = False) -> str:
    """What a freeness figure means to a person: `idle` when nothing runs (an idle instance's freeness
    is just its free blocks), `draining`, or the decode steps of headroom per request."""
    if draining:
        return "draining"
    if freeness is None:
        return "-"
    if idle:
        return "idle"
    if not math.isfinite(freeness):
        return "draining"
    if block_size is None:
        return f"{freeness:.1f} blocks/request"
    return f"{freeness * block_size:.0f} decode steps"
