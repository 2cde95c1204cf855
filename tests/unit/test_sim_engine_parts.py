"""The sim engine's pure parts: request validation, the next-token function, stop handling, and the
SimInstance hooks it drives (abort, scheduled tokens)."""

from __future__ import annotations

import pytest

from llumnix.openai_stream import EndpointKind
from llumnix.sim.instance import EngineConfig, SimInstance
from llumnix.sim.request import FINISHED, SimRequest
from llumnix.sim_engine.engine import Generation
from llumnix.sim_engine.requests import GenerationRequest, RequestError, parse_request
from llumnix.sim_engine.tokens import EOS_TOKEN_ID, TokenGenerator, apply_chat_template, encode


def _instance(blocks: int = 20) -> SimInstance:
    return SimInstance("i", EngineConfig(total_blocks=blocks, block_size=4, watermark=0.0), lambda *_: 0.01)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    instance = _instance()
    running, prefilling, waiting = (SimRequest(name, t, 10, 50) for t, name in enumerate("rpw"))
    instance.enqueue(running)
    instance.plan(0.0)
    instance.complete(0.1)
    instance.enqueue(prefilling)
    instance.plan(0.2)  # prefills `prefilling` while `running` holds its blocks
    instance.enqueue(waiting)
    assert instance.scheduled_tokens() == {"p": 10}
    for request in (running, prefilling, waiting):
        instance.abort(request, 0.3)
        assert request.state == FINISHED and request.blocks == 0
        instance.check_blocks()
    assert instance.complete(0.4) == []  # the planned prefill skips the aborted request
    assert instance.free_blocks == instance.total_blocks and not instance.num_requests


def test_a_decode_step_schedules_one_token_per_running_request() -> None:
    instance = _instance()
    for i in range(3):
        instance.enqueue(SimRequest(f"r{i}", i, 6, 10))
    instance.plan(0.0)
    instance.complete(0.1)
    instance.plan(0.2)
    assert instance.scheduled_tokens() == {"r0": 1, "r1": 1, "r2": 1}
    instance.complete(0.3)
    assert instance.scheduled_tokens() == {}


def test_next_token_depends_only_on_the_sequence_tail() -> None:
    tokens = TokenGenerator(seed=3)
    assert tokens.next_token([1, 2, 3, 4, 5], True) == tokens.next_token([9, 9, 2, 3, 4, 5], True)
    assert tokens.next_token([1, 2, 3], True) != TokenGenerator(seed=4).next_token([1, 2, 3], True)
    assert all(32 <= tokens.next_token([i], True) <= 126 for i in range(300))


def test_eos_comes_only_when_enabled_and_allowed() -> None:
    eos = TokenGenerator(seed=0, eos_probability=0.3)
    drawn = [eos.next_token([i, i + 1], True) for i in range(1000)]
    assert 200 < drawn.count(EOS_TOKEN_ID) < 400
    assert EOS_TOKEN_ID not in [eos.next_token([i, i + 1], False) for i in range(1000)]
    assert EOS_TOKEN_ID not in [TokenGenerator().next_token([i, i + 1], True) for i in range(1000)]


def _generation(**params: object) -> Generation:
    request = GenerationRequest(EndpointKind.COMPLETION, (1, 2), **params)  # type: ignore[arg-type]
    return Generation("e", request, SimRequest("e", 0.0, 2, request.max_tokens), 0.0)


def _drain(generation: Generation) -> list[tuple[str, str | None, int | str | None]]:
    out = []
    while not generation.outputs.empty():
        delta = generation.outputs.get_nowait()
        out.append((delta.text, delta.finish_reason, delta.stop_reason))
    return out


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_hold_back_text_that_may_start_one(include: bool) -> None:
    generation = _generation(max_tokens=20, stop=("xyz",), include_stop_str_in_output=include)
    for char in "abxyxyz":
        generation.add_token(ord(char))
    deltas = _drain(generation)
    streamed = [text for text, _, _ in deltas]
    # Without the stop string in the output, two characters wait while they could start "xyz".
    assert streamed[:3] == (["a", "b", "x"] if include else ["", "", "a"])
    assert "".join(streamed) == ("abxyxyz" if include else "abxy")
    assert deltas[-1][1:] == ("stop", "xyz")


def test_min_tokens_defers_stop_token_ids_and_max_tokens_ends_with_length() -> None:
    generation = _generation(max_tokens=4, min_tokens=3, stop_token_ids=frozenset({ord("a")}))
    for char in "aaa":
        generation.add_token(ord(char))
    assert [d[1:] for d in _drain(generation)] == [(None, None), (None, None), ("stop", ord("a"))]
    capped = _generation(max_tokens=2)
    capped.add_token(ord("q"))
    capped.add_token(ord("q"))
    assert _drain(capped)[-1][1] == "length"


def test_max_tokens_defaults_and_limits_follow_vllm() -> None:
    chat = parse_request(
        EndpointKind.CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "max_completion_tokens": 7},
        "m",
        100,
    )
    assert chat.max_tokens == 7
    assert chat.prompt_token_ids == tuple(encode(apply_chat_template([{"role": "user", "content": "hi"}])))
    assert parse_request(EndpointKind.COMPLETION, {"prompt": "abc"}, "m", 100).max_tokens == 16
    assert (
        parse_request(EndpointKind.COMPLETION, {"prompt": [1] * 95, "max_tokens": 50}, "m", 100).max_tokens
        == 5
    )
    whole_context = parse_request(
        EndpointKind.CHAT, {"messages": [{"role": "user", "content": ""}]}, "m", 100
    )
    assert whole_context.max_tokens == 100 - len(whole_context.prompt_token_ids)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a", "n": 2},
        {"prompt": ["a", "b"]},
        {"prompt": "a", "echo": True},
        {"prompt": "a", "logprobs": 1},
    ],
)
def test_unsimulated_features_are_refused_clearly(body: dict[str, object]) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(EndpointKind.COMPLETION, body, "m", 100)
    assert info.value.status == 400
    assert "simulated engine" in info.value.body["error"]["message"]


def test_a_cache_salt_is_validated_as_vllm_does() -> None:
    salted = parse_request(EndpointKind.COMPLETION, {"prompt": "a", "cache_salt": "tenant-a"}, "m", 100)
    assert salted.cache_salt == "tenant-a"
    assert parse_request(EndpointKind.COMPLETION, {"prompt": "a"}, "m", 100).cache_salt is None
    for bad in ("", 7, "a/b", "x" * 129):
        with pytest.raises(RequestError) as info:
            parse_request(EndpointKind.COMPLETION, {"prompt": "a", "cache_salt": bad}, "m", 100)
        assert info.value.status == 400 and info.value.body["error"]["param"] == "cache_salt"
        assert "Parameter 'cache_salt' must" in info.value.body["error"]["message"]
