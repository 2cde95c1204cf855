"""The llumlet's request book and the OpenAI stream <-> chunk conversions it records from."""

from __future__ import annotations

import pytest

from llumlet.admission import AdmissionError, validate_body
from llumlet.http_front import client_view
from llumlet.requests import DuplicateRequestError, RequestRecord, RequestTable
from llumnix.openai_request import BYTES_PER_TOKEN_ESTIMATE, PromptSizer, estimate_prompt_tokens
from llumnix.openai_stream import EndpointKind, GenerationChunk, ResponseAssembler, Usage, parse_stream_chunk

COMPLETION_STREAM = [
    {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
     "choices": [{"index": 0, "text": "He", "token_ids": [11], "prompt_token_ids": [1, 2, 3],
                  "finish_reason": None, "logprobs": {"tokens": ["He"], "token_logprobs": [-0.1],
                                                      "top_logprobs": [None], "text_offset": [0]}}],
     "usage": None},
    {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
     "choices": [{"index": 0, "text": "llo", "token_ids": [12, 13], "finish_reason": "length",
                  "stop_reason": None, "logprobs": {"tokens": ["l", "lo"], "token_logprobs": [-0.2, -0.3],
                                                    "top_logprobs": [None, None], "text_offset": [2, 3]}}],
     "usage": None},
    {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [],
     "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}},
]

CHAT_STREAM = [
    {"id": "chatcmpl-1", "model": "tiny", "prompt_token_ids": [5, 6],
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"id": "chatcmpl-1", "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": "Hi", "tool_calls": [
         {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]},
         "token_ids": [7], "finish_reason": None}]},
    {"id": "chatcmpl-1", "model": "tiny",
     "choices": [{"index": 0, "delta": {"content": "!", "tool_calls": [
         {"index": 0, "function": {"arguments": ": 1}"}}]}, "token_ids": [8], "finish_reason": "stop",
                  "stop_reason": 8}]},
    {"id": "chatcmpl-1", "model": "tiny", "choices": [],
     "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}},
]


def _assemble(endpoint: EndpointKind, stream: list[dict], return_token_ids: bool) -> dict:
    assembler = ResponseAssembler(endpoint, "resp-1", return_token_ids)
    for payload in stream:
        for chunk in parse_stream_chunk(endpoint, payload):
            assembler.add(chunk)
    return assembler.response()


def test_completion_stream_assembles_into_the_non_streaming_response() -> None:
    body = _assemble(EndpointKind.COMPLETION, COMPLETION_STREAM, return_token_ids=True)
    assert body["object"] == "text_completion"
    assert body["model"] == "tiny"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    [choice] = body["choices"]
    assert choice["text"] == "Hello"
    assert choice["token_ids"] == [11, 12, 13]
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["He", "l", "lo"]
    assert choice["logprobs"]["text_offset"] == [0, 2, 3]


def test_chat_stream_assembles_message_and_tool_calls() -> None:
    body = _assemble(EndpointKind.CHAT, CHAT_STREAM, return_token_ids=False)
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Hi!"
    assert choice["message"]["tool_calls"] == [
        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == 8
    assert "token_ids" not in choice and "prompt_token_ids" not in body


def test_usage_only_chunk_becomes_a_token_less_chunk() -> None:
    [chunk] = parse_stream_chunk(EndpointKind.COMPLETION, COMPLETION_STREAM[-1])
    assert chunk.token_ids == () and chunk.usage == Usage(3, 3)


def test_record_follows_the_stream_per_choice() -> None:
    record = RequestRecord("r", EndpointKind.COMPLETION,
                           {"prompt": "Hello", "max_tokens": 5, "temperature": 0.0, "stream": True,
                            "kv_transfer_params": {"x": 1}, "n": 2})
    assert not record.started
    assert record.prompt_tokens == 2  # 5 bytes at 4 bytes per token, rounded up, until known
    for payload in COMPLETION_STREAM:
        for chunk in parse_stream_chunk(EndpointKind.COMPLETION, payload):
            record.observe(chunk)
    record.observe(parse_stream_chunk(EndpointKind.COMPLETION, {
        "choices": [{"index": 1, "text": "x", "token_ids": [99]}]})[0])
    assert record.started
    assert record.prompt_token_ids == (1, 2, 3) and record.prompt_tokens == 3
    assert record.generated_token_ids == {0: [11, 12, 13], 1: [99]}
    assert record.output_tokens == 3
    assert record.finish_reasons == {0: "length"}
    assert record.sampling_params == {"max_tokens": 5, "temperature": 0.0, "n": 2}


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (EndpointKind.COMPLETION, {"prompt": [4, 5, 6, 7]}, 4),
        (EndpointKind.COMPLETION, {"prompt": "x" * 41}, 11),
        (EndpointKind.COMPLETION, {"prompt": ["abcd", "efgh"]}, 2),
        (EndpointKind.CHAT, {"messages": [{"role": "user", "content": "12345678"}]}, 2),
        # Where the llumlet's and the router's estimators used to disagree: a batch of token-id lists
        # (the llumlet said 1), the text parts of list content (it counted the list's repr), an empty
        # message (the router said 0; every prompt runs at least one token).
        (EndpointKind.COMPLETION, {"prompt": [[1, 2, 3], [4, 5]]}, 5),
        (EndpointKind.CHAT, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "12345678"}, {"type": "image_url", "image_url": {"url": "x" * 400}},
        ]}]}, 2),
        (EndpointKind.CHAT, {"messages": [{"role": "user", "content": ""}]}, 1),
    ],
)
def test_prompt_estimate(endpoint: EndpointKind, body: dict, expected: int) -> None:
    assert estimate_prompt_tokens(endpoint, body) == expected


def test_prompt_sizer_learns_the_engines_bytes_per_token_from_text_prompts_only() -> None:
    sizer = PromptSizer(window=8, min_samples=3)
    text = {"prompt": "x" * 600}
    assert sizer.estimates(EndpointKind.COMPLETION, text) == [150]  # 4 bytes per token until it knows
    # Token-id prompts and batches say nothing about text; they are not learnt from.
    sizer.learn(EndpointKind.COMPLETION, {"prompt": [1] * 50}, 50)
    sizer.learn(EndpointKind.COMPLETION, {"prompt": ["ab", "cd"]}, 4)
    assert sizer.bytes_per_token == BYTES_PER_TOKEN_ESTIMATE
    # A byte-level tokenizer (the sim engine's): one token per byte, a chat template's tokens on top.
    sizer.learn(EndpointKind.COMPLETION, {"prompt": "y" * 300}, 300)
    sizer.learn(EndpointKind.COMPLETION, {"prompt": "z" * 100}, 100)
    sizer.learn(EndpointKind.CHAT, {"messages": [{"role": "user", "content": "w" * 80}]}, 100)
    assert sizer.bytes_per_token == pytest.approx(480 / 500)
    assert sizer.estimates(EndpointKind.COMPLETION, text) == [625]
    assert sizer.estimates(EndpointKind.COMPLETION, {"prompt": [7] * 9}) == [9]  # ids stay exact
    # The window forgets: a new model's ratio takes over.
    for _ in range(8):
        sizer.learn(EndpointKind.COMPLETION, {"prompt": "v" * 800}, 100)
    assert sizer.bytes_per_token == 8.0
    sizer.learn(EndpointKind.COMPLETION, {"prompt": "v" * 800}, 1)  # absurd: clamped
    assert sizer.bytes_per_token <= PromptSizer.MAX_BYTES_PER_TOKEN


def test_a_record_estimates_its_prompt_at_the_ratio_it_was_admitted_with() -> None:
    record = RequestRecord("r", EndpointKind.COMPLETION, {"prompt": "x" * 600}, bytes_per_token=1.0)
    assert record.prompt_tokens == 600
    record.observe(GenerationChunk(index=0, prompt_token_ids=(1,) * 598))
    assert record.prompt_tokens == 598


def test_table_counts_and_refuses_duplicate_ids() -> None:
    table = RequestTable()
    table.add(RequestRecord("a", EndpointKind.COMPLETION, {"prompt": "x"}, high_priority=True))
    table.add(RequestRecord("b", EndpointKind.CHAT, {"messages": []}))
    with pytest.raises(DuplicateRequestError):
        table.add(RequestRecord("a", EndpointKind.COMPLETION, {"prompt": "y"}))
    assert [r.request_id for r in table] == ["a", "b"]
    assert table.high_priority_ids() == {"a"}
    assert table.remove("a") is not None and table.remove("a") is None
    assert (len(table), table.admitted_total, table.finished_total) == (1, 2, 1)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (EndpointKind.COMPLETION, [1, 2], None),
        (EndpointKind.COMPLETION, {"max_tokens": 3}, "prompt"),
        (EndpointKind.COMPLETION, {"prompt": 5}, "prompt"),
        (EndpointKind.CHAT, {"messages": []}, "messages"),
        (EndpointKind.CHAT, {"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": 3},
         "kv_transfer_params"),
    ],
)
def test_malformed_bodies_get_an_openai_400(endpoint: EndpointKind, body: object, param: str | None) -> None:
    with pytest.raises(AdmissionError) as info:
        validate_body(endpoint, body)
    assert info.value.status == 400
    assert info.value.body["error"]["code"] == 400
    assert info.value.body["error"]["param"] == param


def test_streamed_chunks_lose_what_only_the_llumlet_asked_for() -> None:
    first = {"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [1], "prompt_token_ids": [9]}],
             "usage": None}
    usage_only = COMPLETION_STREAM[-1]
    plain = {"prompt": "x", "stream": True}
    assert client_view(first, plain) == {"id": "c", "choices": [{"index": 0, "text": "a"}], "usage": None}
    assert client_view(usage_only, plain) is None
    asked = {**plain, "return_token_ids": True, "stream_options": {"include_usage": True}}
    assert client_view(first, asked) == first
    assert client_view(usage_only, asked) == usage_only
