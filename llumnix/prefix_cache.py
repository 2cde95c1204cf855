"""Prefix-cache blocks: one canonical hash of a KV block's content, and an index of which instance
caches which blocks.

A block's hash chains over the request's token ids the way vLLM's prefix cache does: each *full*
block of `block_size` tokens is named by hash(parent block's hash, its token ids), so equal hashes
mean equal prefixes up to and including that block. The hash is 64 bits of BLAKE2b over fixed-width
little-endian integers: the same in every process and on every machine (Python's `hash()` is salted
per process), so an engine, its llumlet, every router replica and the simulator agree on it.

What vLLM folds into its block hashes besides the tokens ("extra keys") is taken in through the
chain's root (`root_hash`): the request's `cache_salt` (vLLM: in its first block's hash) and LoRA
adapter (vLLM: in every block's). Either way two sequences that differ in them share no block, and
that is all a root decides: the first block's hash differs, so every hash chained to it differs.
Multimodal inputs and prompt embeddings, vLLM's other extra keys, are not hashed: blocks holding
them are neither reported nor looked up.

`PrefixIndex` answers, for a request's block hashes, how many leading blocks each instance has
cached (the longest chain match). It is fed with what instances report: blocks stored and removed
since their previous report, or the whole set on (re)subscription.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

ROOT_HASH = 0
"""The parent of a sequence's first block (a request without a cache salt or a LoRA adapter)."""

_TOKEN_DTYPE = np.dtype("<u4")


def root_hash(cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """The parent of the first block of a request with this cache salt and LoRA adapter (the
    adapter's name, as vLLM's `--lora-modules NAME=PATH` names it); ROOT_HASH for neither. An empty
    salt is no salt (vLLM's)."""
    if not cache_salt and lora_name is None:
        return ROOT_HASH
    digest = hashlib.blake2b(b"llumnix-root", digest_size=8)
    for key in (cache_salt or None, lora_name):
        # Length-prefixed, so no two different (salt, adapter) pairs encode alike.
        encoded = b"" if key is None else key.encode()
        digest.update((-1 if key is None else len(encoded)).to_bytes(8, "little", signed=True) + encoded)
    return int.from_bytes(digest.digest(), "little")


def block_hash(parent: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """The hash of one full block with these token ids after the block hashed `parent`."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    digest.update(np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT_HASH
) -> list[int]:
    """Hashes of the full blocks of `token_ids` (a partial last block has none), in order."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    tokens = np.asarray(token_ids, dtype=_TOKEN_DTYPE)
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int] | np.ndarray, block_size: int, root: int = ROOT_HASH
) -> list[int]:
    """`hashes` (of the full blocks of a prefix of `token_ids`, chained from `root`) extended to
    every full block of `token_ids`; the list is extended in place and returned."""
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else root
    hashes.extend(block_hashes(token_ids[start:], block_size, parent))
    return hashes


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Most prompt blocks a cache hit can cover: an engine computes at least the prompt's last token
    (it needs its logits), so a hit stops at the last full block before it."""
    return max(0, prompt_tokens - 1) // block_size


class PrefixIndex:
    """Which instance has which blocks cached, kept from the instances' reports."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        """Block hash -> instances that have it cached."""
        self._blocks: dict[str, set[int]] = {}
        """Instance id -> its cached block hashes."""

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, instance_id: str) -> frozenset[int]:
        return frozenset(self._blocks.get(instance_id, ()))

    def apply(
        self, instance_id: str, stored: Iterable[int], removed: Iterable[int], reset: bool = False
    ) -> None:
        """One report: `stored` blocks became cached on the instance, `removed` ones were evicted;
        `reset`: the report lists the whole cache (what was known before is dropped first)."""
        if reset:
            self.drop(instance_id)
        blocks = self._blocks.setdefault(instance_id, set())
        for block in removed:
            if block in blocks:
                blocks.discard(block)
                holders = self._holders[block]
                holders.discard(instance_id)
                if not holders:
                    del self._holders[block]
        for block in stored:
            if block not in blocks:
                blocks.add(block)
                self._holders.setdefault(block, set()).add(instance_id)

    def drop(self, instance_id: str) -> None:
        """Forget an instance (removed, or its report stream restarted)."""
        for block in self._blocks.pop(instance_id, ()):
            holders = self._holders[block]
            holders.discard(instance_id)
            if not holders:
                del self._holders[block]

    def cached_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Instance id -> how many leading blocks of `hashes` it has cached, for every instance that
        has at least the first one."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        matched: dict[str, int] = {}
        candidates = set(first)
        for depth in range(1, len(hashes)):
            holders = self._holders.get(hashes[depth])
            if holders is None:
                break
            if not candidates.issubset(holders):
                for instance_id in candidates - holders:
                    matched[instance_id] = depth
                candidates &= holders
                if not candidates:
                    break
        else:
            depth = len(hashes)
        for instance_id in candidates:
            matched[instance_id] = depth
        return matched

