"""Shared-prefix traces: requests of a group start with the same system prompt, a session's next
turn extends the previous prompt and its answer, the same arguments give the same tokens."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llumnix.traces import SHARED_PREFIX_TRACES, generate_trace, request_token_ids


@pytest.mark.parametrize("name", list(SHARED_PREFIX_TRACES))
def test_shape_and_reproducibility(name: str) -> None:
    trace = generate_trace(name, 300, 10.0, seed=3)
    assert len(trace) == 300
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)
    for r in trace:
        assert sum(tokens for _, tokens in r.segments) == r.prompt_tokens + r.output_tokens
        assert r.segments[-1][1] == r.output_tokens
    again = generate_trace(name, 300, 10.0, seed=3)
    assert again == trace
    assert np.array_equal(request_token_ids(again[7]), request_token_ids(trace[7]))
    assert generate_trace(name, 300, 10.0, seed=4) != trace


def test_groups_share_their_system_prompt() -> None:
    trace = generate_trace("prefix-groups", 200, 10.0)
    by_prompt: dict[int, list] = {}
    for r in trace:
        by_prompt.setdefault(r.segments[0][0], []).append(r)
    shared = next(group for group in by_prompt.values() if len(group) > 1)
    a, b = (request_token_ids(r) for r in shared[:2])
    system = shared[0].segments[0][1]
    assert np.array_equal(a[:system], b[:system])
    assert not np.array_equal(a[system : system + 8], b[system : system + 8])


def test_a_sessions_next_turn_extends_the_previous_prompt_and_answer() -> None:
    trace = generate_trace("prefix-sessions", 400, 10.0)
    by_first: dict[tuple[int, int], list] = {}
    for r in trace:
        by_first.setdefault(r.segments[1], []).append(r)  # the first message names the session
    session = max(by_first.values(), key=len)
    assert len(session) >= 2
    for earlier, later in itertools.pairwise(session):
        whole = request_token_ids(earlier)
        assert later.arrival_time > earlier.arrival_time
        assert np.array_equal(request_token_ids(later)[: len(whole)], whole)


def test_the_papers_traces_share_nothing() -> None:
    trace = generate_trace("M-M", 50, 5.0)
    assert all(not r.segments for r in trace) and request_token_ids(trace[0]).size == 0
