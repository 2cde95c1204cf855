"""The engine's prefix cache as the llumlet knows it, and each load subscriber's view of it.

The engine's snapshots carry numbered updates (`PrefixCacheUpdate`, engine.proto); the mirror
applies them in order, and on a gap (a missed update) waits for the engine's next full update,
keeping what it knew meanwhile. Every change goes into a bounded log; a `WatchLoad` stream keeps a
cursor into it and sends, with each load, only the changes since its previous load
(`PrefixCacheChanges`, llumlet.proto): the whole cache once when it subscribes, or when its cursor
fell out of the log, never on every load.
"""

from __future__ import annotations

from llumnix.v1.engine_pb2 import PrefixCacheUpdate
from llumnix.v1.llumlet_pb2 import InstanceLoad, PrefixCacheChanges

LOG_LIMIT = 1 << 16
"""Changes kept for subscribers; one further behind gets the whole cache instead."""


class PrefixCacheMirror:
    def __init__(self, log_limit: int = LOG_LIMIT) -> None:
        self.log_limit = log_limit
        self._blocks: set[int] = set()
        self._until: int | None = None
        """The engine's update number last applied; None: waiting for a full update."""
        self._log: list[tuple[int, bool]] = []
        """(block, stored) in order; entry i is change number `_log_start + i + 1`."""
        self._log_start = 0

    @property
    def version(self) -> int:
        """Counts changes (a subscriber's cursor)."""
        return self._log_start + len(self._log)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def apply(self, update: PrefixCacheUpdate) -> bool:
        """One engine update; True when the cache changed."""
        before = self.version
        if update.full:
            blocks = set(update.stored)
            for block in self._blocks - blocks:
                self._record(block, False)
            for block in blocks - self._blocks:
                self._record(block, True)
            self._blocks = blocks
        elif self._until is not None and update.since == self._until:
            for block in update.removed:
                if block in self._blocks:
                    self._blocks.discard(block)
                    self._record(block, False)
            for block in update.stored:
                if block not in self._blocks:
                    self._blocks.add(block)
                    self._record(block, True)
        else:
            self._until = None  # missed one: what it says is relative to a state we do not have
            return False
        self._until = update.until
        return self.version != before

    def engine_restarted(self) -> None:
        """A new engine process: its cache starts empty, and its updates are numbered anew."""
        for block in self._blocks:
            self._record(block, False)
        self._blocks = set()
        self._until = None

    def _record(self, block: int, stored: bool) -> None:
        self._log.append((block, stored))
        if len(self._log) > self.log_limit:
            drop = len(self._log) - self.log_limit // 2
            del self._log[:drop]
            self._log_start += drop

    def changes_since(self, cursor: int | None) -> tuple[PrefixCacheChanges | None, int]:
        """The changes a subscriber at `cursor` has not seen (None: nothing), and its new cursor. A
        new subscriber (None) or one behind the log gets the whole cache."""
        version = self.version
        if cursor is None or cursor < self._log_start:
            return PrefixCacheChanges(full=True, stored=self._blocks), version
        if cursor == version:
            return None, version
        stored: set[int] = set()
        removed: set[int] = set()
        for block, is_stored in self._log[cursor - self._log_start :]:
            if is_stored:
                removed.discard(block)
                stored.add(block)
            else:
                stored.discard(block)
                removed.add(block)
        return PrefixCacheChanges(stored=stored, removed=removed), version

    def fill(self, message: InstanceLoad, cursor: int | None) -> int:
        """Adds the subscriber's changes to its next load message; returns its new cursor."""
        changes, cursor = self.changes_since(cursor)
        if changes is not None:
            message.prefix_cache.CopyFrom(changes)
        return cursor
