"""A simulated instance's prefix cache, as vLLM keeps it: full blocks named by their content hash
(`llumnix.prefix_cache`), shared by every request that holds the same prefix, and kept when freed.

A block no request holds stays cached among the free blocks until an allocation needs it: free
cached blocks are evicted least recently freed first (a request's tail blocks are freed first, so
they go before its head, as vLLM orders its free queue). A request that finds its leading blocks
cached skips their prefill; blocks other running requests hold take no memory again.

The cache counts what changed since `take_changes` was last called: the blocks that became cached
and those evicted (what an engine reports to its llumlet, and what the simulator's dispatch index
follows).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockCache:
    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        """Block hash -> requests holding that block (>= 1)."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request holds, the first to be evicted first."""
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self.shared_refs = 0
        """References beyond the first to held blocks: blocks counted by more than one request."""

    def __contains__(self, block: int) -> bool:
        return block in self._refs or block in self._free

    def __len__(self) -> int:
        return len(self._refs) + len(self._free)

    @property
    def free_cached(self) -> int:
        """Cached blocks among the free ones."""
        return len(self._free)

    def blocks(self) -> set[int]:
        return {*self._refs, *self._free}

    def hit(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        for depth, block in enumerate(hashes):
            if block not in self._refs and block not in self._free:
                return depth
        return len(hashes)

    def shared(self, hashes: Iterable[int]) -> int:
        """How many of these blocks other requests hold (they take no new memory)."""
        return sum(1 for block in hashes if block in self._refs)

    def acquire(self, hashes: Iterable[int]) -> int:
        """A request takes these blocks (cached or new); returns how many of them take a free block
        (all but the ones already held)."""
        taken = 0
        for block in hashes:
            refs = self._refs.get(block)
            if refs is not None:
                self._refs[block] = refs + 1
                self.shared_refs += 1
                continue
            taken += 1
            if block in self._free:
                del self._free[block]
            else:
                self._added(block)
            self._refs[block] = 1
        return taken

    def release(self, hashes: Sequence[int], content: Sequence[int] = ()) -> int:
        """A request frees its blocks: `hashes` are the ones it acquired, `content` the hashes of
        its other full blocks (filled while it ran), which become cached unless already are. Returns
        how many acquired blocks no request holds any more (they return to the free blocks)."""
        freed = 0
        for block in reversed(content):
            if block not in self._refs and block not in self._free:
                self._free[block] = None
                self._added(block)
        for block in reversed(hashes):
            refs = self._refs[block]
            if refs > 1:
                self._refs[block] = refs - 1
                self.shared_refs -= 1
                continue
            del self._refs[block]
            self._free[block] = None
            freed += 1
        return freed

    def fit(self, free_blocks: int) -> None:
        """Evict free cached blocks until at most `free_blocks` remain (an allocation took the rest)."""
        while len(self._free) > free_blocks:
            block, _ = self._free.popitem(last=False)
            self._evicted(block)

    def drop_free(self, block: int) -> None:
        """Evict one free cached block (a block arriving with the same content replaces it)."""
        if block in self._free:
            del self._free[block]
            self._evicted(block)

    def _added(self, block: int) -> None:
        if block in self._removed:
            self._removed.discard(block)
        else:
            self._stored.add(block)

    def _evicted(self, block: int) -> None:
        if block in self._stored:
            self._stored.discard(block)
        else:
            self._removed.add(block)

    def take_changes(self) -> tuple[set[int], set[int]]:
        """(blocks cached, blocks evicted) since the previous call."""
        stored, removed = self._stored, self._removed
        self._stored, self._removed = set(), set()
        return stored, removed
