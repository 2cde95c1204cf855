"""The plugin that bounds vLLM's shm queue readers: applied only where the launcher asked for it, to
queues created afterwards, and idempotent (vLLM loads general plugins once per process, but a test
process may apply it more than once)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import zmq

from llumnix.engine.vllm_shm_wait import BUSY_ENV, RECHECK_ENV, bound_reader_waits, register
from llumnix.launch.engine_process import EngineLaunchConfig, build_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)")


@pytest.fixture
def shm_broadcast() -> Iterator[object]:
    from vllm.distributed.device_communicators import shm_broadcast
    init, recheck = shm_broadcast.SpinCondition.__init__, shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS
    yield shm_broadcast
    shm_broadcast.SpinCondition.__init__ = init
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck


def _reader_busy_s(shm_broadcast: object) -> float:
    condition = shm_broadcast.SpinCondition(True, zmq.Context.instance(), "inproc://llumnix-shm-test")
    try:
        return condition.busy_loop_s
    finally:
        condition.local_notify_socket.close(linger=0)
        condition.read_cancel_socket.close(linger=0)
        condition.write_cancel_socket.close(linger=0)


def test_bounds_apply_to_readers_created_afterwards(shm_broadcast: object) -> None:
    assert _reader_busy_s(shm_broadcast) == 1  # vLLM's default: a second of spinning
    assert bound_reader_waits(0.002, 2)
    assert bound_reader_waits(0.003, 3)  # again: wraps vLLM's own initialiser, not the previous wrapper
    assert _reader_busy_s(shm_broadcast) == 0.003
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 3


def test_the_plugin_does_nothing_unless_the_launcher_set_both_variables(
        shm_broadcast: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BUSY_ENV, raising=False)
    monkeypatch.setenv(RECHECK_ENV, "2")
    register()
    assert _reader_busy_s(shm_broadcast) == 1
    monkeypatch.setenv(BUSY_ENV, "0.002")
    register()
    assert _reader_busy_s(shm_broadcast) == 0.002 and shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 2


def test_cpu_engines_are_launched_with_the_bounds() -> None:
    _, cpu_env = build_command(EngineLaunchConfig(model="m", port=1))
    assert float(cpu_env[BUSY_ENV]) < 0.01 and 1 <= int(cpu_env[RECHECK_ENV]) <= 10
    _, gpu_env = build_command(EngineLaunchConfig(model="m", port=1, device="gpu"))
    assert BUSY_ENV not in gpu_env and RECHECK_ENV not in gpu_env


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="recheck"):
        bound_reader_waits(0.002, 0)
