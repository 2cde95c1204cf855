"""The simulated instance's prefix cache (`llumnix.sim.block_cache`): hits skip prefill, shared
blocks take memory once, freed blocks stay cached until evicted (least recently freed first), a
migrated request's blocks become cached on its destination, and every change is reported."""

from __future__ import annotations

from llumnix.prefix_cache import PrefixIndex, block_hashes
from llumnix.profile import RooflineLatency
from llumnix.sim.block_cache import BlockCache
from llumnix.sim.instance import EngineConfig, SimInstance
from llumnix.sim.migration import Migration, Outcome
from llumnix.sim.request import FINISHED, PREFILLING, RUNNING, SimRequest

LATENCY = RooflineLatency(
    weights_read_s=0.02, linear_s_per_token=1e-4, prefill_attention_s_per_square_token=0.0,
    decode_attention_s_per_context_token=0.0, overhead_s=0.0,
)
SHARED = list(range(1000, 1000 + 16 * 8))  # 8 blocks every request below starts with


def instance(name: str = "a", blocks: int = 100) -> SimInstance:
    config = EngineConfig(total_blocks=blocks, block_size=16, watermark=0.0, prefix_caching=True)
    return SimInstance(name, config, LATENCY.iteration_time)


def request(rid: str, own: int, prompt_extra: int = 24, output: int = 4) -> SimRequest:
    tokens = SHARED + [own] * (prompt_extra + output)
    prompt = len(SHARED) + prompt_extra
    return SimRequest(rid, 0.0, prompt, output, block_hashes=block_hashes(tokens, 16))


def run_until(inst: SimInstance, done: SimRequest, now: float = 0.0) -> float:
    while done.state != FINISHED:
        duration = inst.plan(now)
        assert duration is not None
        now += duration
        inst.complete(now)
        inst.check_blocks()
    return now


def test_a_hit_skips_the_cached_prefill_and_shares_the_blocks() -> None:
    inst = instance()
    first, second = request("first", 1, output=200), request("second", 2)
    inst.enqueue(first)
    inst.plan(0.0)
    assert first.prefilled == 0 and inst.free_blocks == 100 - 10  # 152 tokens: 10 blocks
    inst.complete(1.0)
    inst.enqueue(second)
    inst.plan(1.0)
    # The 8 shared blocks are cached (and held by `first`): only the rest is computed and allocated.
    assert second.prefilled == 16 * 8 and inst.prefix_hit_tokens == 16 * 8
    assert inst.free_blocks == 100 - 10 - 2
    inst.complete(2.0)
    inst.check_blocks()


def test_freed_blocks_stay_cached_until_an_allocation_evicts_them_tail_first() -> None:
    inst = instance(blocks=20)
    first = request("first", 1)
    inst.enqueue(first)
    run_until(inst, first)
    assert inst.free_blocks == 20 and inst.cache is not None
    cached = block_hashes(SHARED + [1] * 28, 16)  # 9 full blocks: prompt and the output written
    assert inst.cache.hit(cached) == 9 and inst.cache.free_cached == 9
    hog = SimRequest("hog", 0.0, 16 * 12, 4)  # content of its own: 12 of 20 free blocks
    inst.enqueue(hog)
    inst.plan(10.0)
    assert inst.free_blocks == 8 and inst.cache.hit(cached) == 8  # one evicted: the tail
    stored, removed = inst.cache.take_changes()
    assert stored == set(cached) - {cached[8]} and removed == set()  # stored, then evicted: never reported


def test_preemption_keeps_the_cache_and_the_recompute_hits_it() -> None:
    inst = instance(blocks=20)
    a = SimRequest("a", 0.0, 136, 60, block_hashes=block_hashes([1] * 196, 16))
    b = SimRequest("b", 1.0, 136, 60, block_hashes=block_hashes([2] * 196, 16))
    inst.enqueue(a)
    inst.enqueue(b)
    now = 0.0
    while b.preemptions == 0 or b.state != RUNNING:
        duration = inst.plan(now)
        assert duration is not None
        if b.preemptions and b.state == PREFILLING:
            break  # b is admitted again
        now += duration
        inst.complete(now)
        inst.check_blocks()
    assert b.preemptions == 1 and b.prefilled > 0 and b.prefilled % 16 == 0
    assert inst.prefix_hit_tokens == b.prefilled


def test_migration_caches_the_request_on_its_destination() -> None:
    src, dst = instance("src"), instance("dst")
    r = request("r", 1, output=300)
    src.enqueue(r)
    src.plan(0.0)
    src.complete(0.1)
    assert r.state == RUNNING
    src.cache.take_changes()  # type: ignore[union-attr]
    migration = Migration(r, src, dst, lambda tokens: 0.001, max_stages=2)
    at = migration.start(0.1)
    while at is not None:
        at = migration.on_stage_end(at)
    assert migration.outcome is Outcome.COMPLETED
    src.check_blocks()
    dst.check_blocks()
    index = PrefixIndex()
    for inst in (src, dst):
        stored, removed = inst.cache.take_changes()  # type: ignore[union-attr]
        index.apply(inst.instance_id, stored, removed)
    assert index.cached_blocks(r.block_hashes[:8]) == {"dst": 8}  # the source's copy was never reported
    # The source's blocks are free again and still cached there.
    assert src.free_blocks == 100 and src.cache.hit(r.block_hashes[:8]) == 8  # type: ignore[union-attr]


def test_changes_cancel_within_one_report() -> None:
    cache = BlockCache()
    cache.acquire([1, 2])
    cache.release([1, 2])
    cache.fit(0)
    assert cache.take_changes() == (set(), set())
    cache.acquire([3])
    assert cache.take_changes() == ({3}, set())
    cache.release([3])
    cache.fit(0)
    assert cache.take_changes() == (set(), {3})
