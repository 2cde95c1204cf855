"""Where instances come from: the one interface the control loop drives. Local mode implements it with
processes (engine + llumlet per instance), the operator with pods. The loop never starts, stops or
names an instance any other way.

An instance moves through phases STARTING -> READY -> (TERMINATING) -> gone, or to FAILED at any time.
The backend reports phases as it observes them (process exited, pod not ready); the loop decides what
to do about them (replace a FAILED instance, stop a drained one)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass


class InstancePhase(enum.Enum):
    STARTING = "starting"
    """Created, not yet serving (engine loading, pod pending)."""
    READY = "ready"
    """The llumlet answers at `address`."""
    TERMINATING = "terminating"
    """Being stopped."""
    FAILED = "failed"
    """Died or cannot start; the loop replaces it."""


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    instance_id: str
    phase: InstancePhase
    address: str | None
    """The llumlet's gRPC address (host:port) once known."""
    created_at: float
    """Seconds since the epoch (start-up grace is measured from here)."""
    template_hash: str = ""
    """Digest of the engine template the instance was created from (a change means rolling
    replacement); empty when the backend does not track templates."""
    message: str = ""
    """Why the instance is FAILED or not yet READY, for status and logs."""


class InstanceBackend(ABC):
    @abstractmethod
    async def list_instances(self) -> list[InstanceInfo]:
        """Every instance the backend holds now, in any phase."""

    @abstractmethod
    async def start_instance(self) -> InstanceInfo:
        """Create one instance from the current template; returns at once (phase STARTING)."""

    @abstractmethod
    async def stop_instance(self, instance_id: str) -> None:
        """Stop and remove the instance (the loop drains it first). Idempotent."""

    @abstractmethod
    async def close(self) -> None:
        """Release what the backend holds (local mode stops its processes; the operator's pods stay)."""
