"""Engine side: the prefix cache's changes, as each snapshot reports them (`PrefixCacheUpdate`,
proto/llumnix/v1/engine.proto).

The engine tells the reporter which blocks (canonical hashes, `llumnix.prefix_cache`) became cached
and which were evicted; each snapshot carries the changes since the previous one, numbered so that
the reader notices one it missed (the snapshot channel drops messages a slow reader cannot take).
Every `full_every_s` an update lists the whole cache instead, so a reader that missed one catches up
without asking (the channel is one-way).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

from llumnix.v1.engine_pb2 import PrefixCacheUpdate

FULL_EVERY_S = 5.0
KV_EVENTS_SUFFIX = ".kv-events"


def kv_events_address(snapshot_addr: str) -> str | None:
    """Where the launcher has vLLM publish its KV events (`llumnix.engine.vllm_kv_events` reads them):
    `<ipc snapshot address>.kv-events`; None for a non-ipc snapshot address."""
    return snapshot_addr + KV_EVENTS_SUFFIX if snapshot_addr.startswith("ipc://") else None


class PrefixCacheReporter:
    """Thread-safe: the engine may report changes on one thread while snapshots are built on another."""

    def __init__(self, full_every_s: float = FULL_EVERY_S) -> None:
        self.full_every_s = full_every_s
        self._lock = threading.Lock()
        self._cached: set[int] = set()
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._sequence = 0
        self._last_full = -math.inf

    def __len__(self) -> int:
        return len(self._cached)

    def stored(self, blocks: Iterable[int]) -> None:
        with self._lock:
            self._store(blocks)

    def _store(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block in self._cached:
                continue
            self._cached.add(block)
            if block in self._removed:
                self._removed.discard(block)
            else:
                self._stored.add(block)

    def removed(self, blocks: Iterable[int]) -> None:
        with self._lock:
            self._remove(blocks)

    def _remove(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block not in self._cached:
                continue
            self._cached.discard(block)
            if block in self._stored:
                self._stored.discard(block)
            else:
                self._removed.add(block)

    def cleared(self) -> None:
        """The engine dropped its whole cache (vLLM's reset_prefix_cache)."""
        with self._lock:
            self._remove(list(self._cached))

    def update(self, now: float) -> PrefixCacheUpdate | None:
        """What the next snapshot reports; None when nothing changed and no full update is due."""
        with self._lock:
            return self._update(now)

    def _update(self, now: float) -> PrefixCacheUpdate | None:
        full = now - self._last_full >= self.full_every_s
        if not (full or self._stored or self._removed):
            return None
        since = self._sequence
        self._sequence += 1
        if full:
            self._last_full = now
            message = PrefixCacheUpdate(since=since, until=self._sequence, full=True, stored=self._cached)
        else:
            message = PrefixCacheUpdate(since=since, until=self._sequence, stored=self._stored,
                                        removed=self._removed)
        self._stored, self._removed = set(), set()
        return message


def merge_updates(first: PrefixCacheUpdate, then: PrefixCacheUpdate) -> PrefixCacheUpdate:
    """One update for two consecutive ones (a reader that drained both at once); a gap between them
    is kept (`then` alone: its reader will wait for a full update)."""
    if then.full or first.until != then.since:
        return then
    removed = set(then.removed)
    stored = set(then.stored)
    return PrefixCacheUpdate(
        since=first.since,
        until=then.until,
        full=first.full,
        stored=(set(first.stored) - removed) | stored,
        removed=set() if first.full else (set(first.removed) - stored) | removed,
    )
