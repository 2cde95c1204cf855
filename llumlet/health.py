"""The llumlet's health: engine reachable, where the load comes from, draining."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from llumlet.admission import Admission
from llumlet.load_tracker import LoadTracker


class HealthStatus(str, enum.Enum):
    SERVING = "serving"
    """Engine healthy, load from the connector's snapshots."""
    DEGRADED = "degraded"
    """Engine healthy, but snapshots stopped: load from the engine's /metrics."""
    NOT_SERVING = "not-serving"
    """Engine unreachable or dead: requests are refused and in-flight ones failed."""


@dataclass(frozen=True, slots=True)
class HealthReport:
    status: HealthStatus
    instance_id: str
    engine_healthy: bool
    draining: bool
    snapshots_stalled: bool
    snapshot_age_s: float
    in_flight: int
    message: str

    @property
    def serving(self) -> bool:
        """Whether the process is fit to serve (draining is a normal state, not a failure)."""
        return self.status is not HealthStatus.NOT_SERVING

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "instance_id": self.instance_id,
            "engine_healthy": self.engine_healthy,
            "draining": self.draining,
            "load_source": "metrics-fallback" if self.snapshots_stalled else "connector",
            "snapshot_age_s": None if math.isinf(self.snapshot_age_s) else round(self.snapshot_age_s, 3),
            "in_flight": self.in_flight,
            "message": self.message,
        }


class HealthReporter:
    def __init__(self, admission: Admission, tracker: LoadTracker) -> None:
        self.admission = admission
        self.tracker = tracker

    def report(self) -> HealthReport:
        snapshots = self.tracker.snapshot_health()
        engine_healthy = self.admission.engine_healthy
        if not engine_healthy:
            status, message = HealthStatus.NOT_SERVING, "engine is not answering its /health"
        elif snapshots.stalled:
            since = ("no engine snapshot received yet" if math.isinf(snapshots.age_s)
                     else f"no engine snapshot for {snapshots.age_s:.1f} s while the engine has work")
            status, message = HealthStatus.DEGRADED, f"{since}: load from the engine's /metrics"
        else:
            status, message = HealthStatus.SERVING, ""
        if self.admission.shutting_down:
            message = (message + "; " if message else "") + "shutting down"
        return HealthReport(
            status=status,
            instance_id=self.tracker.instance_id,
            engine_healthy=engine_healthy,
            draining=self.tracker.draining,
            snapshots_stalled=snapshots.stalled,
            snapshot_age_s=snapshots.age_s,
            in_flight=len(self.tracker.requests),
            message=message,
        )
