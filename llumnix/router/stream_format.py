"""Spliced `GenerationChunk`s back into OpenAI stream chunks (what vLLM's server sends)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage


@dataclass(frozen=True, slots=True)
class StreamFormat:
    endpoint: EndpointKind
    response_id: str
    created: int
    return_token_ids: bool = False

    def _base(self, model: str) -> dict[str, Any]:
        chat = self.endpoint is EndpointKind.CHAT
        return {"id": self.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": model}

    def chunk(self, chunk: GenerationChunk, model: str) -> dict[str, Any]:
        # Runs for every token: one dict per level, no copies (orjson writes tuples as arrays).
        payload = self._base(model)
        if self.endpoint is EndpointKind.CHAT:
            delta = {"role": chunk.role, "content": chunk.text} if chunk.role else {"content": chunk.text}
            if chunk.extra_delta:
                delta.update(chunk.extra_delta)
            choice = {"index": chunk.index, "delta": delta, "logprobs": chunk.logprobs,
                      "finish_reason": chunk.finish_reason, "stop_reason": chunk.stop_reason}
            if self.return_token_ids and chunk.prompt_token_ids:
                payload["prompt_token_ids"] = chunk.prompt_token_ids
        else:
            choice = {"index": chunk.index, "text": chunk.text, "logprobs": chunk.logprobs,
                      "finish_reason": chunk.finish_reason, "stop_reason": chunk.stop_reason}
            if self.return_token_ids and chunk.prompt_token_ids:
                choice["prompt_token_ids"] = chunk.prompt_token_ids
        if self.return_token_ids:
            choice["token_ids"] = chunk.token_ids
        payload["choices"] = [choice]
        return payload

    def events(self, chunks: list[GenerationChunk], model: str) -> bytes:
        """The chunks as server-sent events, ready for one write."""
        return b"".join([sse_event(self.chunk(chunk, model)) for chunk in chunks])

    def usage(self, usage: Usage, model: str) -> dict[str, Any]:
        return {**self._base(model), "choices": [],
                "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                          "total_tokens": usage.total_tokens}}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
