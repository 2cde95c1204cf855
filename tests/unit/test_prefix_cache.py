"""The canonical block hash and the per-instance index of cached blocks (`llumnix.prefix_cache`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llumnix.prefix_cache import (
    ROOT_HASH,
    PrefixIndex,
    block_hash,
    block_hashes,
    cacheable_blocks,
    extend_block_hashes,
    root_hash,
)


def test_full_blocks_only_and_chained() -> None:
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # 8 tokens of a third block: no hash
    assert hashes[0] == block_hash(ROOT_HASH, tokens[:16])
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])
    # The same block after a different prefix is a different block.
    other = block_hashes([99, *tokens[1:]], 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert all(0 <= h < 2**64 for h in hashes)


def test_extending_a_prefix_gives_the_hashes_of_the_whole_sequence() -> None:
    tokens = [7] * 50 + list(range(70))
    assert extend_block_hashes(block_hashes(tokens[:40], 16), tokens, 16) == block_hashes(tokens, 16)


def test_the_hash_is_the_same_in_another_process() -> None:
    # Python's hash() would differ per process (PYTHONHASHSEED); routers and engines must agree.
    code = ("from llumnix.prefix_cache import block_hashes, root_hash; "
            "print(block_hashes(list(range(32)), 16), root_hash('s', 'lora'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == f"{block_hashes(list(range(32)), 16)} {root_hash('s', 'lora')}"


def test_a_salted_and_an_unsalted_request_share_no_block_equal_salts_do() -> None:
    tokens = list(range(16 * 4))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, root_hash("tenant-a"))
    index = PrefixIndex()
    index.apply("a", salted, ())
    index.apply("b", plain, ())
    # vLLM salts the first block only; every later block chains to it, so nothing is shared.
    assert not set(salted) & set(plain)
    assert index.cached_blocks(block_hashes(tokens, 16, root_hash("tenant-a"))) == {"a": 4}
    assert index.cached_blocks(block_hashes(tokens, 16, root_hash("tenant-b"))) == {}
    assert index.cached_blocks(plain) == {"b": 4}
    assert root_hash() == root_hash("") == root_hash(None, None) == ROOT_HASH  # no salt, base model
    # A LoRA adapter keys the blocks too; salt and adapter never stand in for each other.
    roots = {root_hash("x"), root_hash(None, "x"), root_hash("x", "x"), root_hash("xx"), root_hash("x", "")}
    assert len(roots) == 5 and ROOT_HASH not in roots
    assert extend_block_hashes([], tokens, 16, root_hash("tenant-a")) == salted


def test_a_hit_leaves_the_prompts_last_token_to_compute() -> None:
    assert cacheable_blocks(32, 16) == 1
    assert cacheable_blocks(33, 16) == 2
    assert cacheable_blocks(0, 16) == 0


def test_index_reports_the_longest_chain_per_instance() -> None:
    hashes = block_hashes(list(range(16 * 5)), 16)
    index = PrefixIndex()
    index.apply("a", hashes[:3], ())
    index.apply("b", hashes, ())
    index.apply("c", hashes[1:], ())  # no first block: nothing usable
    assert index.cached_blocks(hashes) == {"a": 3, "b": 5}
    index.apply("b", (), [hashes[2]])
    assert index.cached_blocks(hashes) == {"a": 3, "b": 2}
    index.apply("a", [hashes[0]], (), reset=True)
    assert index.cached_blocks(hashes) == {"a": 1, "b": 2}
    index.drop("b")
    assert index.cached_blocks(hashes) == {"a": 1}
    assert index.cached_blocks(block_hashes(list(range(1, 17)), 16)) == {}
    assert index.cached_blocks([]) == {}
    index.drop("a")
    index.drop("c")
    assert len(index) == 0


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
