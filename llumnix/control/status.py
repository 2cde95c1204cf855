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
    def average_freeness(self) -> float | None:
        values = [i.freeness for i in self.instances
                  if i.freeness is not None and math.isfinite(i.freeness) and not i.draining]
        return sum(values) / len(values) if values else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict: infinite freeness (draining) becomes null."""
        data = asdict(self)
        data["ready"] = self.ready
        data["average_freeness"] = self.average_freeness
        for instance in data["instances"]:
            if instance["freeness"] is not None and not math.isfinite(instance["freeness"]):
                instance["freeness"] = None
        return data
