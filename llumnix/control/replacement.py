"""Backoff for successors of failed instances: successive failures delay each successor, so a
crash-looping image is not restarted on every pass."""

from __future__ import annotations

REPLACE_BACKOFF_MAX_S = 60.0
"""Successive failures delay each successor 0, 1, 2, 4, ... s up to this; the count resets once
every instance serves."""


class ReplacementBackoff:
    def __init__(self) -> None:
        self.replacements = 0
        self._pending = 0
        """Instances stopped as failed whose successor has not been started yet."""
        self._failures_in_row = 0
        self._not_before = -float("inf")

    def failed(self, now: float) -> None:
        """An instance was stopped as failed; its successor waits out the backoff."""
        self.replacements += 1
        self._pending += 1
        self._failures_in_row += 1
        delay = 0.0 if self._failures_in_row == 1 else 2.0 ** (self._failures_in_row - 2)
        self._not_before = now + min(delay, REPLACE_BACKOFF_MAX_S)

    def holding(self, now: float) -> bool:
        """Whether starting an instance now must wait (a successor is due but backing off)."""
        return self._pending > 0 and now < self._not_before

    def successor_started(self) -> bool:
        """An instance was started: True when it is a failed instance's successor."""
        if not self._pending:
            return False
        self._pending -= 1
        return True

    def no_successor_needed(self) -> None:
        """The target was met otherwise (a lower desired count)."""
        self._pending = 0

    def all_serving(self) -> None:
        self._failures_in_row = 0
