"""Token replay: resume a request on another instance from its prompt and the tokens it already
generated. The engine continues a greedy (or seeded) sequence from prompt + generated token ids
exactly where it stopped, so the client sees every token once.

The replay is always a completion request whose prompt is token ids: a chat request is replayed with
the prompt token ids its first chunk reported (the rendered chat template), so the template is not
applied twice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llumnix.openai_stream import COMPLETION_DEFAULT_MAX_TOKENS, EndpointKind

_NOT_SAMPLING = ("prompt", "messages", "stream", "stream_options", "echo", "suffix", "return_token_ids",
                 "max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of",
                 "truncate_prompt_tokens", "truncation_side", "add_special_tokens")
"""Fields replaced or meaningless in the replay; everything else (sampling parameters, stop
conditions, seed, ignore_eos, ...) is sent again unchanged. The reported prompt ids are already
truncated and tokenized: truncating prompt + generated ids again would cut the context the output
continues from (and misplace a migration's staged KV)."""
_CHAT_TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "add_generation_prompt",
                         "continue_final_message", "documents", "tool_choice", "tools",
                         "parallel_tool_calls", "response_format", "logprobs", "top_logprobs",
                         "reasoning_effort", "include_reasoning")


class NotReplayable(ValueError):
    """The request cannot be resumed by token replay (the message says why)."""


def replay_check(endpoint: EndpointKind, body: dict[str, Any]) -> None:
    """Raises NotReplayable for requests whose output token replay cannot reproduce."""
    for key in ("n", "best_of"):
        if int(body.get(key) or 1) > 1:
            raise NotReplayable(f"requests with {key} > 1 are not resumed")
    if endpoint is EndpointKind.CHAT:
        if body.get("tools") and body.get("tool_choice") != "none":
            raise NotReplayable("chat requests with tools are not resumed (tool calls are parsed by the "
                                "chat endpoint)")
        if (body.get("response_format") or {}).get("type", "text") != "text":
            raise NotReplayable("chat requests with a response_format are not resumed")
        if body.get("logprobs"):
            raise NotReplayable("chat requests with logprobs are not resumed (completion logprobs differ)")


def remaining_max_tokens(endpoint: EndpointKind, body: dict[str, Any], prompt_tokens: int,
                         generated_tokens: int, max_model_len: int | None) -> int:
    """Output tokens left to generate after `generated_tokens` (0 when the request is complete)."""
    if endpoint is EndpointKind.CHAT:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is None:
            if max_model_len is None:
                raise NotReplayable("a chat request without max_tokens runs to the end of the context; "
                                    "the router needs --max-model-len to resume it")
            return max(0, max_model_len - prompt_tokens - generated_tokens)
    else:
        limit = body.get("max_tokens") or COMPLETION_DEFAULT_MAX_TOKENS
    return max(0, int(limit) - generated_tokens)


def replay_body(endpoint: EndpointKind, body: dict[str, Any], prompt_token_ids: Sequence[int],
                generated_token_ids: Sequence[int], max_model_len: int | None = None) -> dict[str, Any]:
    """The completion request that continues `body` after `generated_token_ids`."""
    replay_check(endpoint, body)
    if not prompt_token_ids:
        raise NotReplayable("the instance did not report the prompt token ids")
    remaining = remaining_max_tokens(endpoint, body, len(prompt_token_ids), len(generated_token_ids),
                                     max_model_len)
    if remaining <= 0:
        raise NotReplayable("no output tokens left to generate")
    dropped = _NOT_SAMPLING + (_CHAT_TEMPLATE_FIELDS if endpoint is EndpointKind.CHAT else ())
    replay = {key: value for key, value in body.items() if key not in dropped}
    replay["prompt"] = [*prompt_token_ids, *generated_token_ids]
    replay["max_tokens"] = remaining
    if body.get("min_tokens"):
        replay["min_tokens"] = max(0, int(body["min_tokens"]) - len(generated_token_ids))
    return replay
