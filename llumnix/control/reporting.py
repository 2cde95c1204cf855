"""What the control loop says about what it does: events (logged, and handed to the listener: the
operator posts them as Kubernetes events, `llumnix up` prints them) and the last scaling decision."""

from __future__ import annotations

import logging
from collections.abc import Callable

from llumnix.control.status import ControlEvent, ScalingDecision

logger = logging.getLogger("llumnix.control")


class Reporter:
    def __init__(self, on_event: Callable[[ControlEvent], None] | None, clock: Callable[[], float],
                 aggregate_freeness: Callable[[], float | None]) -> None:
        """`aggregate_freeness()` is the service's aggregate freeness now (None: no load yet); each
        decision records it."""
        self.on_event = on_event
        self.clock = clock
        self.aggregate_freeness = aggregate_freeness
        self.last_decision: ScalingDecision | None = None

    def decide(self, kind: str, reason: str, instance_id: str | None = None) -> None:
        self.last_decision = ScalingDecision(kind, reason, self.clock(), instance_id,
                                             self.aggregate_freeness())

    def event(self, kind: str, reason: str, message: str, instance_id: str | None = None) -> None:
        event = ControlEvent(kind, reason, message, instance_id)
        log = logger.warning if kind == "Warning" else logger.info
        log(message, extra={"reason": reason, "instance_id": instance_id})
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # the listener's failure must not stop the loop
                logger.exception("event listener failed")
