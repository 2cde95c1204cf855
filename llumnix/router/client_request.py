"""From a client's HTTP request to what the router dispatches: limits (body size, max_tokens, prompt
length) with OpenAI-style 400s, priority (header, or a body field that is removed before forwarding),
the fields the router and the llumlet consume instead of the engine (`stream`, `stream_options`,
`return_token_ids`, read as vLLM reads them: `read_stream_fields`) and the prompt-length estimate the
in-flight accounting uses."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llumnix.openai_request import (
    BYTES_PER_TOKEN_ESTIMATE,
    check_generation_body,
    prompt_token_estimates,
    read_stream_fields,
)
from llumnix.openai_stream import EndpointKind
from llumnix.router.errors import RouterError
from llumnix.router.generation import ClientRequest

PRIORITY_VALUES = {"high": True, "normal": False, "low": False}



@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int = 8 << 20
    max_tokens: int | None = None
    """Largest max_tokens / max_completion_tokens a client may ask for."""
    max_prompt_tokens: int | None = None
    """Longest prompt, as `prompt_token_estimates` counts it (each prompt of a batch on its own; the
    engine checks the exact length against its context)."""


@dataclass(frozen=True, slots=True)
class PrioritySettings:
    header: str = "x-llumnix-priority"
    body_field: str = "priority"
    """A string value (`high`, `normal`, `low`) is the router's and removed; vLLM's own integer
    `priority` passes through unchanged."""


def parse_client_request(endpoint: EndpointKind, body: Any, headers: Mapping[str, str],
                         limits: RequestLimits, priorities: PrioritySettings,
                         bytes_per_token: float = BYTES_PER_TOKEN_ESTIMATE) -> ClientRequest:
    """Raises OpenAIRequestError (400) for a body the router refuses; the engine validates the rest.
    `bytes_per_token`: the text size of a token (`PromptSizer`'s learnt ratio)."""
    body = dict(check_generation_body(endpoint, body))
    read_stream_fields(body)
    high_priority = headers.get(priorities.header, "").strip().lower() == "high"
    field = body.get(priorities.body_field)
    if isinstance(field, str):
        if field.lower() not in PRIORITY_VALUES:
            raise RouterError(400, f"'{priorities.body_field}' must be one of {', '.join(PRIORITY_VALUES)}",
                              param=priorities.body_field)
        high_priority = high_priority or PRIORITY_VALUES[field.lower()]
    if field is None or isinstance(field, str):
        # The router's own value, or null (unset, as for every optional OpenAI field): not the engine's.
        body.pop(priorities.body_field, None)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RouterError(400, f"'{key}' must be a positive integer", param=key)
        if limits.max_tokens is not None and value > limits.max_tokens:
            raise RouterError(400, f"'{key}' is {value}; this service allows at most {limits.max_tokens}",
                              param=key)
    prompt_estimates = prompt_token_estimates(endpoint, body, bytes_per_token)
    longest_prompt = max(prompt_estimates)
    if limits.max_prompt_tokens is not None and longest_prompt > limits.max_prompt_tokens:
        param = "messages" if endpoint is EndpointKind.CHAT else "prompt"
        raise RouterError(400, f"the prompt is about {longest_prompt} tokens; this service allows at most "
                          f"{limits.max_prompt_tokens}", param=param)
    return ClientRequest(request_id=f"router-{uuid.uuid4().hex}", endpoint=endpoint, body=body,
                         high_priority=high_priority,
                         prompt_tokens_estimate=sum(prompt_estimates))
