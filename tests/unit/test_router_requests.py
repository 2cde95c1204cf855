"""The router's pure parts: request parsing and limits, priorities, API keys, instance addresses,
token-replay bodies and OpenAI stream chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llumnix.openai_replay import NotReplayable, remaining_max_tokens, replay_body
from llumnix.openai_request import OpenAIRequestError
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage
from llumnix.router.api_keys import ApiKeyChecker, load_api_keys
from llumnix.router.client_request import PrioritySettings, RequestLimits, parse_client_request
from llumnix.router.errors import RouterError
from llumnix.router.instance_source import FileInstanceSource, parse_addresses
from llumnix.router.stream_format import StreamFormat, sse_event

COMPLETION = EndpointKind.COMPLETION
CHAT = EndpointKind.CHAT


def parse(body: object, endpoint: EndpointKind = COMPLETION, headers: dict[str, str] | None = None,
          limits: RequestLimits | None = None):
    return parse_client_request(endpoint, body, headers or {},
                                limits or RequestLimits(), PrioritySettings())


def test_priority_from_header_and_body_field_which_is_removed() -> None:
    assert not parse({"prompt": "hi"}).high_priority
    assert parse({"prompt": "hi"}, headers={"x-llumnix-priority": "HIGH"}).high_priority
    request = parse({"prompt": "hi", "priority": "high"})
    assert request.high_priority and "priority" not in request.body
    # vLLM's own integer priority is the engine's business: passed through untouched
    request = parse({"prompt": "hi", "priority": -1})
    assert request.body["priority"] == -1 and not request.high_priority
    with pytest.raises(RouterError) as err:
        parse({"prompt": "hi", "priority": "urgent"})
    assert err.value.status == 400 and err.value.body["error"]["param"] == "priority"


def test_limits_give_openai_400s_naming_the_field() -> None:
    limits = RequestLimits(max_tokens=100, max_prompt_tokens=10)
    with pytest.raises(RouterError) as err:
        parse({"prompt": "hi", "max_tokens": 101}, limits=limits)
    assert err.value.status == 400 and err.value.body["error"]["param"] == "max_tokens"
    assert "at most 100" in err.value.body["error"]["message"]
    with pytest.raises(RouterError) as err:
        parse({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}, CHAT,
              limits=limits)
    assert err.value.body["error"]["param"] == "max_completion_tokens"
    with pytest.raises(RouterError) as err:
        parse({"prompt": list(range(11))}, limits=limits)
    assert err.value.body["error"]["param"] == "prompt"
    assert parse({"prompt": list(range(10)), "max_tokens": 100}, limits=limits).prompt_tokens_estimate == 10
    with pytest.raises(RouterError) as err:
        parse({"prompt": "x" * 41}, limits=limits)  # 4 bytes per token estimate: 11 tokens
    # A batch: the limit is per prompt, the in-flight estimate all of them (it used to be the longest).
    assert parse({"prompt": [list(range(10)), list(range(6))]}, limits=limits).prompt_tokens_estimate == 16
    for bad in ({"prompt": ""}, {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "max_tokens": "3"}, [1]):
        with pytest.raises(OpenAIRequestError) as err:
            parse(bad)
        assert err.value.status == 400
    with pytest.raises(OpenAIRequestError):
        parse({"messages": []}, CHAT)


def test_api_keys_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# service keys\nsk-one\n\nsk-two  # ops\n")
    monkeypatch.setenv("LLUMNIX_API_KEYS", "sk-three, sk-one")
    keys = load_api_keys(keys_file)
    assert keys == (b"sk-one", b"sk-two", b"sk-three")
    checker = ApiKeyChecker(keys)
    assert checker.allows("Bearer sk-two") and checker.allows("bearer sk-three")
    for header in (None, "", "Bearer", "Bearer sk-on", "Basic sk-one", "sk-one"):
        assert not checker.allows(header)
    assert ApiKeyChecker(()).allows(None)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing")


async def test_instance_addresses_from_a_list_or_a_file(tmp_path: Path) -> None:
    assert parse_addresses("a:1, b:2\n# c:3\nd:4 # e:5") == {"a:1", "b:2", "d:4"}
    with pytest.raises(ValueError, match="host:port"):
        parse_addresses("a:1,nope")
    path = tmp_path / "instances"
    path.write_text("a:1\n")
    source = FileInstanceSource(path, poll_interval_s=0.01)
    updates = source.updates()
    assert await anext(updates) == {"a:1"}
    path.write_text("a:1\nb:2\n")
    assert await anext(updates) == {"a:1", "b:2"}


def test_completion_replay_continues_after_the_generated_tokens() -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 10, "min_tokens": 4, "temperature": 0.0,
            "seed": 7, "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True},
            "echo": False, "ignore_eos": True}
    replay = replay_body(COMPLETION, body, (1, 2, 3), [40, 41, 42])
    assert replay == {"model": "m", "prompt": [1, 2, 3, 40, 41, 42], "max_tokens": 7, "min_tokens": 1,
                      "temperature": 0.0, "seed": 7, "stop": ["\n"], "ignore_eos": True}
    # completions default to 16 tokens
    assert replay_body(COMPLETION, {"prompt": "x"}, (1,), [5] * 6)["max_tokens"] == 10
    with pytest.raises(NotReplayable):
        replay_body(COMPLETION, {"prompt": "x", "max_tokens": 3}, (1,), [5, 5, 5])
    with pytest.raises(NotReplayable, match="n > 1"):
        replay_body(COMPLETION, {"prompt": "x", "n": 2}, (1,), [5])


def test_a_replay_does_not_truncate_or_retokenize_the_reported_prompt_again() -> None:
    # The engine reported the prompt as it kept it; cutting prompt + generated to the last 3 ids would
    # drop the context the output continues from.
    body = {"prompt": "a long text", "max_tokens": 10, "truncate_prompt_tokens": 3, "truncation_side": "left",
            "add_special_tokens": False}
    assert replay_body(COMPLETION, body, (7, 8, 9), [40, 41]) == {"prompt": [7, 8, 9, 40, 41],
                                                                   "max_tokens": 8}


def test_chat_replay_goes_through_completions_with_the_templated_prompt_ids() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "temperature": 0.0, "chat_template_kwargs": {}, "add_generation_prompt": True}
    replay = replay_body(CHAT, body, (9, 9), [40])
    assert replay == {"model": "m", "prompt": [9, 9, 40], "max_tokens": 4, "temperature": 0.0}
    no_limit = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(NotReplayable, match="max-model-len"):
        replay_body(CHAT, no_limit, (9, 9), [40])
    assert replay_body(CHAT, no_limit, (9, 9), [40], max_model_len=10)["max_tokens"] == 7
    assert remaining_max_tokens(CHAT, no_limit, 2, 8, 10) == 0
    for extra in ({"tools": [{"type": "function"}]}, {"logprobs": True},
                  {"response_format": {"type": "json_object"}}):
        with pytest.raises(NotReplayable):
            replay_body(CHAT, {**body, **extra}, (9,), [40])


def test_stream_chunks_are_openai_shaped() -> None:
    chat = StreamFormat(CHAT, "chatcmpl-1", 123, return_token_ids=True)
    # As the client reads it: the JSON of the event.
    first = json.loads(sse_event(chat.chunk(GenerationChunk(role="assistant", prompt_token_ids=(1, 2)),
                                            "m")).removeprefix(b"data: "))
    assert first == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123, "model": "m",
                     "prompt_token_ids": [1, 2],
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None, "stop_reason": None, "token_ids": []}]}
    completion = StreamFormat(COMPLETION, "cmpl-1", 123)
    last = completion.chunk(GenerationChunk(token_ids=(5,), text="a", finish_reason="length"), "m")
    assert last["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert completion.usage(Usage(3, 4), "m")["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                          "total_tokens": 7}
