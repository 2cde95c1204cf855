"""Which requests may migrate, over which KV channel, and the request that resumes one elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from llumlet.migration.rules import (
    channel_refusal,
    engine_channel,
    migration_refusal,
    resume_point,
    usable_staged_tokens,
)
from llumlet.requests import RequestRecord
from llumnix.openai_stream import EndpointKind


def _record(endpoint: EndpointKind = EndpointKind.COMPLETION, generated: int = 5,
            **body: Any) -> RequestRecord:
    base: dict[str, Any] = {"model": "m", "max_tokens": 100}
    base.update({"prompt": "hello"} if endpoint is EndpointKind.COMPLETION
                else {"messages": [{"role": "user", "content": "hi"}]})
    base.update(body)
    return RequestRecord("r", endpoint, base, prompt_token_ids=(1, 2, 3),
                         generated_token_ids={0: list(range(10, 10 + generated))} if generated else {},
                         migratable=True)


def test_greedy_and_sampled_requests_may_migrate() -> None:
    assert migration_refusal(_record(temperature=0)) is None
    assert migration_refusal(_record(temperature=0.8, top_p=0.9, logprobs=2)) is None
    assert migration_refusal(_record(EndpointKind.CHAT, temperature=0, max_tokens=50)) is None


@pytest.mark.parametrize(("body", "reason"), [
    ({"n": 2}, "n > 1"),
    ({"best_of": 3}, "best_of > 1"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -0.1}, "frequency_penalty"),
    ({"seed": 7, "temperature": 0.7}, "seeded"),
    ({"stop": ["\n\n"]}, "stop strings"),
    ({"echo": True}, "echo"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"structured_outputs": {"json": {}}}, "structured output"),
    ({"guided_regex": "a+"}, "structured output"),
])
def test_requests_whose_engine_state_does_not_survive_a_restart_are_refused(
        body: dict[str, Any], reason: str) -> None:
    refusal = migration_refusal(_record(**body))
    assert refusal is not None and reason in refusal


def test_seeded_greedy_requests_may_migrate() -> None:
    assert migration_refusal(_record(seed=7, temperature=0)) is None


def test_requests_that_cannot_move_yet_or_at_all() -> None:
    assert "first token" in str(migration_refusal(_record(generated=0)))
    http = _record()
    http.migratable = False
    assert "HTTP front" in str(migration_refusal(http))
    finishing = _record()
    finishing.finish_reasons[0] = "length"
    assert "finishing" in str(migration_refusal(finishing))
    assert "tools" in str(migration_refusal(_record(EndpointKind.CHAT, max_tokens=50,
                                                    tools=[{"type": "function"}])))
    # A chat request without max_tokens runs to the end of a context the llumlet does not know.
    assert migration_refusal(_record(EndpointKind.CHAT, max_tokens=None)) is not None


def test_resume_point_continues_after_the_generated_tokens() -> None:
    record = _record(min_tokens=8, temperature=0.5, logprobs=1, kv_transfer_params={"x": 1})
    point = resume_point(record, {"llumlet_migration_id": "m", "llumlet_staged_tokens": 7})
    assert point.generated_before == 5
    assert point.body["prompt"] == [1, 2, 3, 10, 11, 12, 13, 14]
    assert point.body["max_tokens"] == 95 and point.body["min_tokens"] == 3
    assert point.body["temperature"] == 0.5 and point.body["logprobs"] == 1
    assert point.body["kv_transfer_params"] == {"llumlet_migration_id": "m", "llumlet_staged_tokens": 7}
    # The record is not changed: the request can migrate again from wherever it runs next.
    assert record.body["prompt"] == "hello"


def test_a_chat_request_resumes_as_a_completion_over_its_rendered_prompt() -> None:
    point = resume_point(_record(EndpointKind.CHAT, max_completion_tokens=20, temperature=0))
    assert "messages" not in point.body and point.body["prompt"][:3] == [1, 2, 3]
    assert point.body["max_tokens"] == 15


def test_only_kv_of_tokens_the_llumlet_saw_is_loaded_and_the_newest_is_recomputed() -> None:
    record = _record(generated=5)  # 3 prompt + 5 generated = 8 tokens
    assert usable_staged_tokens(100, record) == 7
    assert usable_staged_tokens(4, record) == 4
    assert usable_staged_tokens(0, record) == 0


@pytest.mark.parametrize(("transport", "source", "destination"), [
    ("auto", "tcp", "tcp"), ("auto", "nccl", "tcp"), ("auto", "nccl", "nccl"),
    ("tcp", "tcp", "tcp"), ("tcp", "nccl", "tcp"), ("nccl", "nccl", "nccl"),
])
def test_a_migration_over_the_destination_engines_channel_is_taken(
        transport: str, source: str, destination: str) -> None:
    assert channel_refusal(transport, source, destination) is None


@pytest.mark.parametrize(("transport", "source", "destination", "reason"), [
    # NCCL needs both engines on it; TCP any sender can use.
    ("auto", "tcp", "nccl", "the source engine runs tcp"),
    ("nccl", "tcp", "nccl", "the source engine runs tcp"),
    ("tcp", "nccl", "nccl", "over tcp only; the destination engine receives over nccl"),
    ("nccl", "tcp", "tcp", "over nccl only; the destination engine receives over tcp"),
    ("nccl", "nccl", "tcp", "over nccl only"),
])
def test_a_migration_over_another_channel_is_refused(
        transport: str, source: str, destination: str, reason: str) -> None:
    refusal = channel_refusal(transport, source, destination)
    assert refusal is not None and reason in refusal


def test_an_engine_without_a_kv_transport_in_its_handshake_receives_over_tcp() -> None:
    assert engine_channel({"kv_transport": None}) == engine_channel({}) == "tcp"
    assert engine_channel({"kv_transport": "nccl"}) == "nccl"
