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
        choice: dict[str, Any] = {"index": chunk.index}
        if self.endpoint is EndpointKind.CHAT:
            delta: dict[str, Any] = {}
            if chunk.role:
                delta["role"] = chunk.role
            delta["content"] = chunk.text
            delta.update(chunk.extra_delta)
            choice["delta"] = delta
        else:
            choice["text"] = chunk.text
        choice["logprobs"] = chunk.logprobs
        choice["finish_reason"] = chunk.finish_reason
        choice["stop_reason"] = chunk.stop_reason
        payload = self._base(model)
        if self.return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if chunk.prompt_token_ids:
                if self.endpoint is EndpointKind.CHAT:
                    payload["prompt_token_ids"] = list(chunk.prompt_token_ids)
                else:
                    choice["prompt_token_ids"] = list(chunk.prompt_token_ids)
        payload["choices"] = [choice]
        return payload

    def events(self, chunks: list[GenerationChunk], model: str) -> bytes:
        """The chunks as server-sent events, ready for one write."""
        return b"".join(sse_event(self.chunk(chunk, model)) for chunk in chunks)

    def usage(self, usage: Usage, model: str) -> dict[str, Any]:
        return {**self._base(model), "choices": [],
                "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                          "total_tokens": usage.total_tokens}}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
