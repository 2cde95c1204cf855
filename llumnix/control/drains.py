"""Which instances the control loop wants draining, why and since when, and when a drained one is
released: once it has reported no requests for a while (a scale-down drain: parked for
`autoscaling.park_s`, `llumnix.policies.autoscaling.release_due`), or at the drain timeout.
Bookkeeping only: the fleet tells the llumlets, the reconcile pass stops what is released."""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass

from llumnix.control.reporting import Reporter
from llumnix.load import InstanceLoad
from llumnix.policies import autoscaling

logger = logging.getLogger("llumnix.control")

EMPTY_BEFORE_RELEASE_S = 1.0
"""A drained instance must report no requests for at least this long before it is stopped (however
short its parking): a request the router dispatched just before the drain may not be listed yet."""


@dataclass
class Drain:
    since: float
    reason: str
    """"scale-down" (the loop chose it; cancelled when the count falls short), "admin" or "adopted"."""
    empty_since: float | None = None


class Drains(Mapping[str, Drain]):
    """Instance id -> its drain; the only writer of the loop's draining set."""

    def __init__(self, reporter: Reporter, clock: Callable[[], float]) -> None:
        self.reporter = reporter
        self.clock = clock
        self._drains: dict[str, Drain] = {}
        self.marked = 0
        """Drains the loop started (adopted ones aside)."""
        self.releases = 0

    def __getitem__(self, instance_id: str) -> Drain:
        return self._drains[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._drains)

    def __len__(self) -> int:
        return len(self._drains)

    def mark(self, instance_id: str, reason: str, why: str) -> None:
        if instance_id in self._drains:
            return
        self.reporter.decide("drain", why, instance_id)  # first: it records the freeness decided on
        self._drains[instance_id] = Drain(self.clock(), reason)
        self.marked += 1
        self.reporter.event("Normal", "Draining", f"{why}; migrating its requests out", instance_id)

    def adopt(self, instance_id: str) -> None:
        """An instance found draining (its load says so) after the loop (re)started."""
        if instance_id in self._drains:
            return
        self._drains[instance_id] = Drain(self.clock(), "adopted")
        logger.info("adopted a draining instance", extra={"instance_id": instance_id})

    def cancel(self, instance_id: str, why: str) -> None:
        """The instance serves again (an event says why, if it was draining)."""
        if self._drains.pop(instance_id, None) is not None:
            self.reporter.event("Normal", "DrainCancelled", why, instance_id)

    def forget(self, instance_id: str) -> None:
        """Drop a drain silently: its instance is being replaced."""
        self._drains.pop(instance_id, None)

    def keep_only(self, instance_ids: Container[str]) -> None:
        """Drop drains of instances that are gone (stopped elsewhere, or their failure was handled)."""
        for instance_id in [i for i in self._drains if i not in instance_ids]:
            del self._drains[instance_id]

    def cancellable(self) -> list[str]:
        """Drains the loop chose for scale-down, by id (admin and adopted drains are kept)."""
        return sorted(i for i, d in self._drains.items() if d.reason != "admin")

    def release_due(self, instance_id: str, load: InstanceLoad | None, migrating: bool, now: float,
                    timeout_s: float, park_s: float) -> bool:
        """Whether the draining instance is to be stopped now (then its drain ends here): empty for
        `park_s` (a scale-down drain; a scale-up meanwhile cancels it) or EMPTY_BEFORE_RELEASE_S
        (any other), or still holding requests after `timeout_s` of draining."""
        drain = self._drains[instance_id]
        empty = load is not None and autoscaling.drained_empty(load) and not migrating
        drain.empty_since = (drain.empty_since or now) if empty else None
        parked_for = max(park_s if drain.reason == "scale-down" else 0.0, EMPTY_BEFORE_RELEASE_S)
        if autoscaling.release_due(drain.empty_since, now, parked_for):
            self.reporter.decide("release", "drained instance is empty", instance_id)
            self.reporter.event("Normal", "Released", "drained and empty; stopping it", instance_id)
        elif empty:
            return False  # parked: a drain timeout is for requests that do not leave
        elif now - drain.since > timeout_s:
            running = load.num_requests if load is not None else "unknown"
            self.reporter.decide("release", f"drain timeout ({timeout_s:.0f} s)", instance_id)
            self.reporter.event("Warning", "DrainTimeout", f"still holds {running} requests after "
                                f"{timeout_s:.0f} s of draining; stopping it anyway", instance_id)
        else:
            return False
        self.releases += 1
        del self._drains[instance_id]
        return True
