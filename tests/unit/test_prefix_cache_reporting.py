"""Prefix-cache changes from the engine to the router: the engine's numbered updates (a full list
now and then), the snapshot reader merging what it drains, the llumlet's mirror (gaps wait for a
full update, a new engine starts empty) and each load stream's changes since its previous load."""

from __future__ import annotations

import pytest

from llumlet.prefix_cache import PrefixCacheMirror
from llumnix.engine.prefix_cache_report import PrefixCacheReporter, merge_updates
from llumnix.prefix_cache import PrefixIndex
from llumnix.v1.engine_pb2 import PrefixCacheUpdate
from llumnix.v1.llumlet_pb2 import LOAD_SOURCE_CONNECTOR, InstanceLoad
from llumnix.wire import report_from_proto


def test_updates_carry_changes_since_the_previous_and_a_full_list_now_and_then() -> None:
    reporter = PrefixCacheReporter(full_every_s=10.0)
    reporter.stored([1, 2, 3])
    first = reporter.update(0.0)
    assert first is not None and first.full and set(first.stored) == {1, 2, 3}
    assert reporter.update(1.0) is None  # nothing changed
    reporter.removed([2, 9])  # 9 was never cached
    reporter.stored([4])
    reporter.stored([5])
    reporter.removed([5])  # cancels within one update
    delta = reporter.update(2.0)
    assert delta is not None and not delta.full
    assert (delta.since, delta.until) == (first.until, first.until + 1)
    assert set(delta.stored) == {4} and set(delta.removed) == {2}
    reporter.cleared()
    assert len(reporter) == 0
    full = reporter.update(10.0)
    assert full is not None and full.full and list(full.stored) == []


def test_merging_drained_updates_keeps_every_change_and_any_gap() -> None:
    a = PrefixCacheUpdate(since=0, until=1, stored=[1, 2])
    b = PrefixCacheUpdate(since=1, until=2, stored=[3], removed=[1])
    merged = merge_updates(a, b)
    assert (merged.since, merged.until, set(merged.stored), set(merged.removed)) == (0, 2, {2, 3}, {1})
    gap = PrefixCacheUpdate(since=5, until=6, stored=[7])
    assert merge_updates(a, gap) == gap


def test_the_mirror_applies_in_order_and_waits_for_a_full_list_after_a_gap() -> None:
    mirror = PrefixCacheMirror()
    assert not mirror.apply(PrefixCacheUpdate(since=0, until=1, stored=[1]))  # no base yet
    assert mirror.apply(PrefixCacheUpdate(since=0, until=1, full=True, stored=[1, 2]))
    assert mirror.apply(PrefixCacheUpdate(since=1, until=2, stored=[3], removed=[1]))
    assert {b for b in (1, 2, 3) if b in mirror} == {2, 3}
    assert not mirror.apply(PrefixCacheUpdate(since=7, until=8, stored=[4]))  # missed some
    assert not mirror.apply(PrefixCacheUpdate(since=8, until=9, stored=[5]))  # still waiting
    assert 4 not in mirror and 5 not in mirror and 2 in mirror  # keeps what it knew
    assert mirror.apply(PrefixCacheUpdate(since=9, until=10, full=True, stored=[2, 5]))
    assert {b for b in (2, 3, 5) if b in mirror} == {2, 5}
    mirror.engine_restarted()
    assert len(mirror) == 0


def test_each_stream_gets_only_its_changes_and_the_router_index_follows() -> None:
    mirror = PrefixCacheMirror(log_limit=8)
    mirror.apply(PrefixCacheUpdate(since=0, until=1, full=True, stored=[1, 2]))
    index = PrefixIndex()

    def send(cursor: int | None) -> int:
        message = InstanceLoad(instance_id="a", block_size=16, source=LOAD_SOURCE_CONNECTOR)
        cursor = mirror.fill(message, cursor)
        changes = report_from_proto(message).prefix_changes
        if changes is not None:
            index.apply("a", changes.stored, changes.removed, changes.full)
        return cursor

    cursor = send(None)  # subscribe: the whole cache
    assert index.blocks_of("a") == {1, 2}
    quiet = InstanceLoad()
    assert mirror.fill(quiet, cursor) == cursor and not quiet.HasField("prefix_cache")
    mirror.apply(PrefixCacheUpdate(since=1, until=2, stored=[3], removed=[1]))
    message = InstanceLoad()
    mirror.fill(message, cursor)
    assert not message.prefix_cache.full and set(message.prefix_cache.stored) == {3}
    cursor = send(cursor)
    assert index.blocks_of("a") == {2, 3}
    for n in range(2, 20):  # more changes than the log keeps: the late stream gets the whole cache
        mirror.apply(PrefixCacheUpdate(since=n, until=n + 1, stored=[100 + n]))
    late = InstanceLoad()
    mirror.fill(late, cursor)
    assert late.prefix_cache.full
    send(cursor)
    assert index.blocks_of("a") == {2, 3, *(100 + n for n in range(2, 20))}


@pytest.mark.parametrize("prompt", [[1, 2, 3], "text", [[1, 2], [3]], []])
def test_token_id_prompts_are_known_without_a_tokenizer(prompt: object) -> None:
    from llumnix.openai_stream import EndpointKind
    from llumnix.router.prompt_ids import token_id_prompt

    expected = (1, 2, 3) if prompt == [1, 2, 3] else ()
    assert token_id_prompt(EndpointKind.COMPLETION, {"prompt": prompt}) == expected
    assert token_id_prompt(EndpointKind.CHAT, {"messages": [{"role": "user", "content": "x"}]}) == ()
