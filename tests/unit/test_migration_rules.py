"""Which requests may migrate, over which KV channel, and the request that resumes one elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from llumlet.migration.rules import (
    CPU_DEFAULT_CHANNEL,
    answer_refusal,
    choose_channel,
    engine_channels,
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


CPU = ["tcp", "gloo"]
CUDA = ["tcp", "gloo", "nccl"]


@pytest.mark.parametrize(("source_transport", "destination_transport", "source", "destination", "channel"), [
    # auto on both sides: nccl when both engines are on CUDA, else the CPU default.
    ("auto", "auto", CUDA, CUDA, "nccl"),
    ("auto", "auto", CUDA, CPU, CPU_DEFAULT_CHANNEL),
    ("auto", "auto", CPU, CPU, CPU_DEFAULT_CHANNEL),
    ("", "auto", CPU, CPU, CPU_DEFAULT_CHANNEL),  # a source that sends no transport is on auto
    ("auto", "auto", ["tcp"], ["tcp"], "tcp"),  # engines without pair channels (sim engines)
    # one side set: that one, whatever the other (auto) says.
    ("gloo", "auto", CPU, CPU, "gloo"),
    ("auto", "gloo", CPU, CUDA, "gloo"),
    ("tcp", "auto", CUDA, CUDA, "tcp"),
    ("nccl", "nccl", CUDA, CUDA, "nccl"),
])
def test_the_channel_follows_the_llumlets_settings_and_the_engines(
        source_transport: str, destination_transport: str, source: list[str], destination: list[str],
        channel: str) -> None:
    assert choose_channel(source_transport, destination_transport, source, destination) == (channel, None)


@pytest.mark.parametrize(("source_transport", "destination_transport", "source", "destination", "reason"), [
    ("nccl", "auto", CUDA, CPU, "the KV channel is nccl (it needs a CUDA GPU on both engines); the "
                                 "destination engine has only tcp, gloo"),
    ("auto", "nccl", CPU, CUDA, "the source engine has only tcp, gloo"),
    ("gloo", "auto", ["tcp"], CPU, "the KV channel is gloo; the source engine has only tcp"),
    ("tcp", "gloo", CPU, CPU, "the source llumlet migrates KV over tcp only, the destination over gloo only"),
])
def test_a_mismatch_is_refused_with_its_reason(source_transport: str, destination_transport: str,
                                               source: list[str], destination: list[str],
                                               reason: str) -> None:
    channel, refusal = choose_channel(source_transport, destination_transport, source, destination)
    assert channel == "" and refusal is not None and reason in refusal


@pytest.mark.parametrize(("transport", "chosen", "backend", "reason"), [
    ("auto", "tcp", "", None),
    ("auto", "gloo", "gloo", None),
    ("gloo", "gloo", "gloo", None),
    ("tcp", "gloo", "gloo", "this llumlet migrates KV over tcp only; the destination chose gloo"),
    ("auto", "nccl", "nccl", "the destination chose nccl; this engine has only tcp, gloo"),
    ("auto", "gloo", "", "the destination chose gloo but opened no gloo channel"),
])
def test_the_source_checks_the_channel_in_the_answer(transport: str, chosen: str, backend: str,
                                                     reason: str | None) -> None:
    assert answer_refusal(transport, CPU, chosen, backend) == reason


def test_an_engine_without_kv_channels_in_its_handshake_has_tcp() -> None:
    assert engine_channels({"kv_channels": None}) == engine_channels({}) == ["tcp"]
    assert engine_channels({"kv_channels": CUDA}) == CUDA
