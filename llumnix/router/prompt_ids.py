"""The token ids of a request's prompt, where the router knows them without a tokenizer: a
completion whose prompt is one list of token ids. Prefix-aware dispatch looks these up in the
instances' prefix caches; text prompts, chat requests and batches are dispatched by load alone."""

from __future__ import annotations

from typing import Any

from llumnix.openai_stream import EndpointKind


def token_id_prompt(endpoint: EndpointKind, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt's token ids; empty when the prompt is text, a batch or a chat."""
    if endpoint is not EndpointKind.COMPLETION:
        return ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return ()
