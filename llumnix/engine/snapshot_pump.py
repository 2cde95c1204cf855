"""Publishes engine snapshots from a background thread, so an engine step only pays for a capture.

The engine's scheduler thread `submit`s each step's `EngineState`; the pump builds the protobuf message
and publishes it. Only the newest state matters (the llumlet reads only the newest message too), so a
state that arrives while the previous one is still being built replaces it instead of queueing. The
prefix cache's changes are not a state but a stream: each snapshot carries all of them since the
previous one (`PrefixCacheReporter`), whichever states were skipped.

vLLM runs no step while it has nothing to do, so the last step's state would go stale (a finished
request would look running forever). When no state has arrived for `idle_refresh_s`, the pump asks
`capture_idle` for a fresh one: read from another thread, but the engine is idle then, and any step
that races with it publishes a correct state right after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from llumnix.engine.engine_snapshot import EngineState, build_snapshot
from llumnix.engine.prefix_cache_report import PrefixCacheReporter
from llumnix.engine.snapshots import SnapshotPublisher

log = logging.getLogger(__name__)


class SnapshotPump:
    def __init__(
        self,
        publisher: SnapshotPublisher,
        engine_id: str,
        block_size: int,
        capture_idle: Callable[[], EngineState | None],
        idle_refresh_s: float = 0.2,
        prefix_cache: PrefixCacheReporter | None = None,
    ) -> None:
        self._publisher = publisher
        self._prefix_cache = prefix_cache
        """Its changes since the previous snapshot go into each one."""
        self._engine_id = engine_id
        self._block_size = block_size
        self._capture_idle = capture_idle
        self._idle_refresh_s = idle_refresh_s
        self._cond = threading.Condition()
        self._pending: EngineState | None = None
        self._last_submit = time.monotonic()
        self._closed = False
        # `step` in the published message: one per snapshot, engine steps and idle refreshes alike.
        self.published = 0
        self.publish_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="llumnix-snapshots", daemon=True)
        self._thread.start()

    def submit(self, state: EngineState) -> None:
        with self._cond:
            self._pending = state
            self._last_submit = time.monotonic()
            self._cond.notify()

    def _next_state(self) -> EngineState | None:
        with self._cond:
            if self._pending is None and not self._closed:
                self._cond.wait(timeout=self._idle_refresh_s)
            if self._closed:
                return None
            state, self._pending = self._pending, None
            idle = time.monotonic() - self._last_submit >= self._idle_refresh_s
        if state is None and idle:
            try:
                state = self._capture_idle()
            except RuntimeError:  # the engine woke up and changed a dict under us; its step publishes
                state = None
        return state

    def _run(self) -> None:
        while not self._closed:
            state = self._next_state()
            if state is None:
                continue
            started = time.perf_counter()
            self.published += 1
            try:
                snapshot = build_snapshot(self._engine_id, self.published, self._block_size, state)
                update = None if self._prefix_cache is None else self._prefix_cache.update(time.time())
                if update is not None:
                    snapshot.prefix_cache.CopyFrom(update)
                self._publisher.publish(snapshot)
            except Exception:  # a broken socket must not take the engine down; the llumlet falls back
                log.exception("publishing an engine snapshot failed")
            self.publish_seconds += time.perf_counter() - started

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=2.0)
        self._publisher.close()
