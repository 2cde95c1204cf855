"""The engine watchdog fails in-flight requests for an engine that refuses or errors, but not for one
that is merely slow to answer /health (a busy CPU engine), until that has lasted the grace period."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from waiting import wait_until

from llumlet.engine_client import EngineHealth
from llumlet.engine_monitor import watch_engine


@dataclass
class _Engine:
    answers: list[EngineHealth]
    checks: int = 0
    """How many times the monitor has asked for /health."""

    async def health(self, timeout_s: float) -> EngineHealth:
        self.checks += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@dataclass
class _Admission:
    engine: _Engine
    engine_healthy: bool = True
    failed_calls: list[str] = field(default_factory=list)
    failed_at_check: list[int] = field(default_factory=list)
    """The engine's check count each time in-flight requests were failed."""

    def fail_all(self, status: int, message: str, err_type: str) -> int:
        self.failed_calls.append(err_type)
        self.failed_at_check.append(self.engine.checks)
        return 1


@dataclass
class _Age:
    age_s: float = 0.0


class _Tracker:
    snapshot_timeout_s = 10.0

    def snapshot_health(self) -> _Age:
        return _Age()

    def notify(self) -> None:
        return None


async def _watch(answers: list[EngineHealth], until: Callable[[_Admission], bool], what: str,
                 slow_grace_s: float) -> _Admission:
    """Runs the monitor until `until(admission)` holds (it has made the checks the test is about)."""
    admission = _Admission(_Engine(answers))
    task = asyncio.create_task(watch_engine(admission, _Tracker(), interval_s=0.01,  # type: ignore[arg-type]
                                            slow_grace_s=slow_grace_s))
    try:
        await wait_until(lambda: until(admission), what)
    finally:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return admission


async def test_refused_checks_mark_the_engine_down_at_once() -> None:
    admission = await _watch([EngineHealth.UNHEALTHY], lambda admission: bool(admission.failed_calls),
                             "the engine marked down", slow_grace_s=60)
    assert admission.failed_at_check == [2]  # failures_to_unhealthy refused checks, no grace
    assert not admission.engine_healthy
    assert admission.failed_calls == ["EngineUnavailable"]


async def test_slow_checks_within_the_grace_keep_requests_running() -> None:
    answers = [EngineHealth.SLOW] * 5 + [EngineHealth.HEALTHY]
    # A 7th check starts only after the monitor has acted on all 5 slow answers and the healthy one.
    admission = await _watch(answers, lambda admission: admission.engine.checks >= 7,
                             "the monitor to have checked past every scripted answer", slow_grace_s=60)
    assert admission.engine.checks >= 7
    assert admission.engine_healthy
    assert admission.failed_calls == []


async def test_an_engine_slow_for_longer_than_the_grace_is_marked_down() -> None:
    admission = await _watch([EngineHealth.SLOW], lambda admission: bool(admission.failed_calls),
                             "the slow engine marked down", slow_grace_s=0.05)
    assert admission.failed_at_check[0] >= 3  # slow checks count only once they outlast the grace
    assert not admission.engine_healthy
    assert admission.failed_calls == ["EngineUnavailable"]
