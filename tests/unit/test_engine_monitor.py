"""The engine watchdog fails in-flight requests for an engine that refuses or errors, but not for one
that is merely slow to answer /health (a busy CPU engine), until that has lasted the grace period."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from llumlet.engine_client import EngineHealth
from llumlet.engine_monitor import watch_engine


@dataclass
class _Engine:
    answers: list[EngineHealth]

    async def health(self, timeout_s: float) -> EngineHealth:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@dataclass
class _Admission:
    engine: _Engine
    engine_healthy: bool = True
    failed_calls: list[str] = field(default_factory=list)

    def fail_all(self, status: int, message: str, err_type: str) -> int:
        self.failed_calls.append(err_type)
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


async def _watch(answers: list[EngineHealth], seconds: float, slow_grace_s: float) -> _Admission:
    admission = _Admission(_Engine(answers))
    task = asyncio.create_task(watch_engine(admission, _Tracker(), interval_s=0.01,  # type: ignore[arg-type]
                                            slow_grace_s=slow_grace_s))
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return admission


async def test_refused_checks_mark_the_engine_down_at_once() -> None:
    admission = await _watch([EngineHealth.UNHEALTHY], 0.1, slow_grace_s=60)
    assert not admission.engine_healthy
    assert admission.failed_calls == ["EngineUnavailable"]


async def test_slow_checks_within_the_grace_keep_requests_running() -> None:
    admission = await _watch([EngineHealth.SLOW] * 5 + [EngineHealth.HEALTHY], 0.2, slow_grace_s=60)
    assert admission.engine_healthy
    assert admission.failed_calls == []


async def test_an_engine_slow_for_longer_than_the_grace_is_marked_down() -> None:
    admission = await _watch([EngineHealth.SLOW], 0.3, slow_grace_s=0.05)
    assert not admission.engine_healthy
    assert admission.failed_calls == ["EngineUnavailable"]
