"""vLLM's KV cache events (as vLLM 0.32's own ZMQ publisher sends them) become the canonical
prefix-cache report: stored blocks chain over their token ids exactly as the router hashes a
prompt, removals and a cleared cache follow, blocks of another hash granularity are left out."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from waiting import wait_until

from llumnix.engine.prefix_cache_report import PrefixCacheReporter
from llumnix.engine.vllm_kv_events import KvEventFeed, KvEventTranslator
from llumnix.prefix_cache import block_hashes, root_hash

TOKENS = list(range(100, 164))  # four blocks of 16


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int = 16,
           lora_name: str | None = None, extra_keys: list[Any] | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       lora_id=1 if lora_name else None, medium="GPU", lora_name=lora_name,
                       extra_keys=extra_keys)


def cached(reporter: PrefixCacheReporter) -> set[int]:
    update = reporter.update(0.0)  # the first update is the whole cache
    assert update is not None and update.full
    return set(update.stored)


def test_stored_blocks_get_the_routers_hashes_and_removals_follow() -> None:
    reporter = PrefixCacheReporter(full_every_s=0.0)
    translator = KvEventTranslator(reporter, 16)
    # vLLM's own hashes are opaque (bytes or ints); a request stores its blocks in two events.
    translator.apply([stored([b"a", b"b"], None, TOKENS[:32]), stored([b"c"], b"b", TOKENS[32:48])])
    expected = block_hashes(TOKENS, 16)[:3]
    assert cached(reporter) == set(expected)
    translator.apply([BlockRemoved(block_hashes=[b"c", b"unknown"], medium="GPU")])
    assert cached(reporter) == set(expected[:2])
    translator.apply([stored([b"x"], b"never-seen", TOKENS[48:64]),  # its prefix was never reported
                      stored([b"y"], None, TOKENS[:8], block_size=8)])  # another hash granularity
    assert cached(reporter) == set(expected[:2])
    translator.apply([AllBlocksCleared()])
    assert cached(reporter) == set()


def test_salted_and_lora_blocks_chain_from_the_requests_root() -> None:
    reporter = PrefixCacheReporter(full_every_s=0.0)
    translator = KvEventTranslator(reporter, 16)
    # vLLM 0.32's extra keys, untagged, one entry per block: the adapter's name on every block, the
    # salt on the first only.
    translator.apply([
        stored([b"s1", b"s2"], None, TOKENS[:32], extra_keys=[("tenant-a",), None]),
        stored([b"s3"], b"s2", TOKENS[32:48]),
        stored([b"l1", b"l2"], None, TOKENS[:32], lora_name="sql",
               extra_keys=[("sql", "tenant-a"), ("sql",)]),
        stored([b"p1"], None, TOKENS[:16]),
    ])
    salted = block_hashes(TOKENS[:48], 16, root_hash("tenant-a"))
    lora = block_hashes(TOKENS[:32], 16, root_hash("tenant-a", "sql"))
    assert cached(reporter) == {*salted, *lora, *block_hashes(TOKENS[:16], 16)}
    assert len({salted[0], lora[0], block_hashes(TOKENS[:16], 16)[0]}) == 3


def test_blocks_with_multimodal_or_embedding_keys_and_their_descendants_are_not_reported() -> None:
    reporter = PrefixCacheReporter(full_every_s=0.0)
    translator = KvEventTranslator(reporter, 16)
    translator.apply([
        # text, then an image (its hash and offset in the block), then text chained to the image
        stored([b"t1", b"m1", b"t2"], None, TOKENS[:48], extra_keys=[None, (["img-hash", 3],), None]),
        stored([b"t3"], b"t2", TOKENS[48:64]),
        stored([b"e1"], None, TOKENS[:16], extra_keys=[(b"embeds-digest",)]),
    ])
    assert cached(reporter) == set(block_hashes(TOKENS[:16], 16))


@pytest.mark.asyncio
async def test_the_feed_reads_vllms_publisher(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    reporter = PrefixCacheReporter(full_every_s=0.0)
    feed = KvEventFeed(endpoint, KvEventTranslator(reporter, 16))
    try:
        expected = set(block_hashes(TOKENS, 16))
        seen: set[int] = set()

        def arrived() -> bool:
            # PUB/SUB drops what is sent before the subscription is up: publish until it arrives.
            publisher.publish(KVEventBatch(ts=0.0, events=[stored([1, 2, 3, 4], None, TOKENS)]))
            update = reporter.update(0.0)
            seen.update(update.stored if update is not None else ())
            return seen == expected

        await wait_until(arrived, "vLLM's published BlockStored to reach the report", timeout_s=20.0)
    finally:
        feed.close()
        publisher.shutdown()
