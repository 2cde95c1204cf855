"""vLLM's KV cache events, translated into the canonical prefix-cache report.

With `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'`
vLLM publishes, every step, the blocks its prefix cache stored (`BlockStored`: vLLM's block hashes,
the parent block's hash, the token ids and the block size), evicted (`BlockRemoved`) or dropped
(`AllBlocksCleared`), msgpack-encoded on a ZeroMQ PUB socket. vLLM's own hashes depend on its
hash function and a per-process seed, so they are translated: a stored block's canonical hash
(`llumnix.prefix_cache.block_hash`) chains over its parent's canonical hash and its token ids,
exactly as the router hashes a prompt. A request's first block chains from the root of its cache
salt and LoRA adapter (`llumnix.prefix_cache.root_hash`), read from the event's `lora_name` and its
per-block `extra_keys`. Blocks with multimodal or prompt-embedding keys, which the router cannot
hash, are not reported, nor are the blocks chained to them. The translation feeds a
`PrefixCacheReporter`, whose changes the snapshot pump puts into each snapshot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from llumnix.engine.prefix_cache_report import PrefixCacheReporter
from llumnix.prefix_cache import block_hash, root_hash

log = logging.getLogger(__name__)


class KvEventTranslator:
    """Blocks of `block_size` tokens (the engine's, which the router hashes prompts with) are reported;
    others (partial blocks of a smaller hash granularity) are not."""

    def __init__(self, reporter: PrefixCacheReporter, block_size: int) -> None:
        self.reporter = reporter
        self.block_size = block_size
        self._canonical: dict[Any, int] = {}
        """vLLM's hash of a cached block -> its canonical hash."""

    def apply(self, events: Iterable[object]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                removed = [self._canonical.pop(h) for h in event.block_hashes if h in self._canonical]
                self.reporter.removed(removed)
            elif isinstance(event, AllBlocksCleared):
                self._canonical.clear()
                self.reporter.cleared()

    def _stored(self, event: BlockStored) -> None:
        if event.block_size != self.block_size:
            return
        parent: int | None = None  # a request's first block: its root comes with its keys
        if event.parent_block_hash is not None:
            if event.parent_block_hash not in self._canonical:
                return  # its prefix was never reported (events were lost or not hashable)
            parent = self._canonical[event.parent_block_hash]
        size = self.block_size
        stored = []
        for i, vllm_hash in enumerate(event.block_hashes):
            try:
                salt = _cache_salt(event.extra_keys[i] if event.extra_keys else None, event.lora_name)
            except _NotHashable:
                break  # multimodal or embeddings: not for the router, nor what chains to it
            if salt is not None and parent is not None:
                break  # a salt past the first block: not vLLM 0.32's layout
            if parent is None:
                parent = root_hash(salt, event.lora_name)
            parent = block_hash(parent, event.token_ids[i * size : (i + 1) * size])
            self._canonical[vllm_hash] = parent
            stored.append(parent)
        self.reporter.stored(stored)


class _NotHashable(ValueError):
    """A block with extra keys the router cannot compute."""


def _cache_salt(keys: Sequence[Any] | None, lora_name: str | None) -> str | None:
    """The cache salt among one block's extra keys (None without one). vLLM 0.32 lists them
    untagged, in this order: the LoRA adapter's name (with `lora_name` set), multimodal
    `(identifier, offset)` pairs, the cache salt (first block only), prompt-embedding digests
    (bytes); anything but the adapter and the salt raises `_NotHashable`."""
    rest = list(keys or ())
    if lora_name is not None and rest and rest[0] == lora_name:
        del rest[0]
    if len(rest) > 1 or (rest and not isinstance(rest[0], str)):
        raise _NotHashable(rest)
    return rest[0] if rest else None


class KvEventFeed:
    """Subscribes to vLLM's KV event socket on a daemon thread and translates every batch."""

    def __init__(self, endpoint: str, translator: KvEventTranslator) -> None:
        self.translator = translator
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint.replace("*", "127.0.0.1", 1))
        self._closed = threading.Event()
        self._last_sequence: int | None = None
        self._thread = threading.Thread(target=self._run, name="llumnix-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                if not self._socket.poll(200):
                    continue
                _topic, sequence, payload = self._socket.recv_multipart()
                number = int.from_bytes(sequence, "big", signed=True)
                if self._last_sequence is not None and number != self._last_sequence + 1:
                    log.warning("llumnix: KV event batches %d..%d lost; the prefix-cache report may miss "
                                "blocks until they are stored again", self._last_sequence + 1, number - 1)
                self._last_sequence = number
                self.translator.apply(self._decoder.decode(payload).events)
            except zmq.ZMQError:
                if not self._closed.is_set():
                    log.exception("llumnix: reading vLLM's KV events failed")
                return
            except Exception:  # a malformed batch must not stop the feed
                log.exception("llumnix: a KV event batch could not be read")

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._socket.close(linger=0)
