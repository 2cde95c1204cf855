"""vLLM's KV cache events (as vLLM 0.32's own ZMQ publisher sends them) become the canonical
prefix-cache report: stored blocks chain over their token ids exactly as the router hashes a
prompt, removals and a cleared cache follow, blocks of another hash granularity are left out."""

from __future__ import annotations

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
from llumnix.prefix_cache import block_hashes

TOKENS = list(range(100, 164))  # four blocks of 16


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       lora_id=None, medium="GPU", lora_name=None)


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
