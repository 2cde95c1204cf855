"""Bounds how long vLLM's shared-memory message-queue readers spin and sleep, in the engine processes
our launcher starts on CPU (a `vllm.general_plugins` entry point, so it runs in EngineCore and in every
worker before their queues exist).

vLLM 0.32 moves every step between EngineCore and its worker through `shm_broadcast.MessageQueue`. A
reader spins (`sched_yield`) for 1 s after each message, then parks on a ZeroMQ notification that can
be lost, and a parked reader that missed it sleeps until its 5 s recheck. Measured on a 2-core machine
with two CPU engines: four readers spin through every decode, starving the llumlets and the engines'
own KV sender and receiver threads, and an engine that had idled for a second picked up its next step
up to 5 s late. Live migrations took 1-15 s (a destination is often idle just before one arrives), with
downtimes of 1-10 s. With a 2 ms spin and a 2 ms recheck they took 40-90 ms with 22-44 ms of downtime,
and two engines decoding side by side produced more tokens per second, not fewer (docs/migration.md).

The launcher (llumnix/launch/engine_process.py) turns it on by setting both variables; without them, or on a
vLLM without these internals, nothing changes.
"""

from __future__ import annotations

import logging
import os

BUSY_ENV = "LLUMNIX_SHM_READER_BUSY_S"
"""Seconds a reader keeps spinning after a message before it parks."""
RECHECK_ENV = "LLUMNIX_SHM_READER_RECHECK_MS"
"""Longest sleep of a parked reader before it looks at the queue again (bounds a lost notification)."""

logger = logging.getLogger("vllm.llumnix")


def bound_reader_waits(busy_s: float, recheck_ms: int) -> bool:
    """Applies the bounds to queues created in this process from now on; False (and nothing changed)
    when this vLLM has no such queue."""
    if busy_s < 0 or recheck_ms < 1:
        raise ValueError("the busy window must not be negative and the recheck at least 1 ms")
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        return False
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    original = getattr(condition.__init__, "__wrapped__", condition.__init__)

    def init(self: object, is_reader: bool, context: object, notify_address: str,
             busy_loop_s: float = busy_s) -> None:
        original(self, is_reader, context, notify_address, busy_loop_s=min(busy_loop_s, busy_s))

    init.__wrapped__ = original  # type: ignore[attr-defined]
    condition.__init__ = init
    return True


def register() -> None:
    """The plugin entry point: applies the bounds set in the environment, if any."""
    busy, recheck = os.environ.get(BUSY_ENV), os.environ.get(RECHECK_ENV)
    if busy is None or recheck is None:
        return
    if bound_reader_waits(float(busy), int(recheck)):
        logger.info("llumnix: shm queue readers spin %s s and recheck every %s ms", busy, recheck)
    else:
        logger.warning("llumnix: this vLLM has no shm queue to bound (%s/%s ignored)", BUSY_ENV, RECHECK_ENV)
