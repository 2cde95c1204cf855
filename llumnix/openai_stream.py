"""OpenAI streaming responses as token-level chunks, and back.

The llumlet reads every engine response as a stream (it must see generated token ids as they are
produced) and turns each streamed OpenAI chunk into `GenerationChunk`s; a non-streaming response
is rebuilt from those chunks by `ResponseAssembler`. The router uses the same assembler for the
chunks it receives over gRPC, so both fronts answer the same OpenAI shapes.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""vLLM's (and OpenAI's) default max_tokens for /v1/completions; chat defaults to the rest of the
context."""


class EndpointKind(str, enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is EndpointKind.COMPLETION else "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class GenerationChunk:
    """Output of one choice since its previous chunk (an engine stream chunk, one choice of it).

    Not frozen: every token builds one or more, and a frozen dataclass's __init__ costs about three
    times as much. Whoever builds a chunk owns it (the router splices the chunks it decoded in place)."""

    index: int = 0
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    """Set on the first chunk of the request only."""
    model: str = ""
    usage: Usage | None = None
    """Set on the last chunk of the request only (choices may be empty then)."""
    role: str = ""
    """Chat only: set on the first chunk of each choice."""
    logprobs: Any = None
    """The chunk's logprobs object exactly as the engine sent it."""
    extra_delta: dict[str, Any] = field(default_factory=dict)
    """Chat only: delta fields other than role/content (reasoning, tool calls), as sent."""


def parse_stream_chunk(endpoint: EndpointKind, payload: dict[str, Any]) -> list[GenerationChunk]:
    """One streamed OpenAI chunk (already JSON-decoded) -> one `GenerationChunk` per choice; a
    usage-only chunk gives one chunk without tokens."""
    model = str(payload.get("model") or "")
    usage = _parse_usage(payload.get("usage"))
    top_prompt_ids = tuple(payload.get("prompt_token_ids") or ())
    chunks = []
    for choice in payload.get("choices") or ():
        if endpoint is EndpointKind.COMPLETION:
            text = choice.get("text") or ""
            role = ""
            extra: dict[str, Any] = {}
            prompt_ids = tuple(choice.get("prompt_token_ids") or ()) or top_prompt_ids
        else:
            delta = dict(choice.get("delta") or {})
            text = delta.pop("content", None) or ""
            role = delta.pop("role", None) or ""
            extra = {k: v for k, v in delta.items() if v is not None}
            prompt_ids = top_prompt_ids
        chunks.append(
            GenerationChunk(
                index=int(choice.get("index", 0)),
                token_ids=tuple(choice.get("token_ids") or ()),
                text=text,
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
                prompt_token_ids=prompt_ids,
                model=model,
                role=role,
                logprobs=choice.get("logprobs"),
                extra_delta=extra,
            )
        )
    if usage is not None:
        if chunks:
            last = chunks[-1]
            chunks[-1] = GenerationChunk(**{**_fields(last), "usage": usage})
        else:
            chunks.append(GenerationChunk(model=model, usage=usage, prompt_token_ids=top_prompt_ids))
    return chunks


def _fields(chunk: GenerationChunk) -> dict[str, Any]:
    return {name: getattr(chunk, name) for name in GenerationChunk.__slots__}


def _parse_usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0))


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class ResponseAssembler:
    """Builds the non-streaming OpenAI response from a request's chunks."""

    def __init__(self, endpoint: EndpointKind, response_id: str, return_token_ids: bool) -> None:
        self.endpoint = endpoint
        self.response_id = response_id
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self.model = ""
        self.prompt_token_ids: tuple[int, ...] = ()
        self.usage: Usage | None = None
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: GenerationChunk) -> None:
        self.model = self.model or chunk.model
        self.prompt_token_ids = self.prompt_token_ids or chunk.prompt_token_ids
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not (chunk.token_ids or chunk.text or chunk.finish_reason or chunk.role or chunk.extra_delta):
            return
        choice = self._choices.setdefault(chunk.index, _Choice())
        choice.text.append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            choice.finish_reason = chunk.finish_reason
            choice.stop_reason = chunk.stop_reason
        if chunk.logprobs is not None:
            choice.logprobs = _merge_logprobs(choice.logprobs, chunk.logprobs)
        _merge_delta(choice.extra, chunk.extra_delta)

    def response(self) -> dict[str, Any]:
        usage = self.usage or Usage(len(self.prompt_token_ids), sum(
            len(c.token_ids) for c in self._choices.values()))
        choices = [self._choice_json(i, c) for i, c in sorted(self._choices.items())]
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "text_completion" if self.endpoint is EndpointKind.COMPLETION else "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            },
        }
        if self.return_token_ids and self.endpoint is EndpointKind.CHAT:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        return body

    def _choice_json(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        text = "".join(choice.text)
        if self.endpoint is EndpointKind.COMPLETION:
            out["text"] = text
        else:
            out["message"] = {"role": "assistant", "content": text, **choice.extra}
        out["logprobs"] = choice.logprobs
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop_reason
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids
            if self.endpoint is EndpointKind.COMPLETION:
                out["prompt_token_ids"] = list(self.prompt_token_ids)
        return out


def _merge_logprobs(acc: Any, new: Any) -> Any:
    """Streamed logprobs are per-chunk lists (completion: parallel lists; chat: `content`)."""
    if acc is None or not isinstance(new, dict):
        return new
    merged = dict(acc)
    for key, value in new.items():
        if isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + value
        elif key not in merged:
            merged[key] = value
    return merged


def _merge_delta(acc: dict[str, Any], delta: dict[str, Any]) -> None:
    """Chat delta fields: strings concatenate; tool calls merge by index (arguments concatenate)."""
    for key, value in delta.items():
        if key == "tool_calls":
            calls = acc.setdefault("tool_calls", [])
            for call in value:
                idx = call.get("index", len(calls))
                while len(calls) <= idx:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                target = calls[idx]
                target["id"] = call.get("id") or target["id"]
                target["type"] = call.get("type") or target["type"]
                function = call.get("function") or {}
                target["function"]["name"] += function.get("name") or ""
                target["function"]["arguments"] += function.get("arguments") or ""
        elif isinstance(value, str):
            acc[key] = acc.get(key, "") + value
        else:
            acc[key] = value


def openai_error(status: int, message: str, err_type: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body (`{"error": {...}}`) that vLLM and OpenAI answer with."""
    default_type = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
                    413: "RequestEntityTooLarge", 422: "UnprocessableEntityError",
                    500: "InternalServerError", 502: "BadGatewayError",
                    503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
    return {"error": {"message": message, "type": err_type or default_type.get(status, "Error"),
                      "param": param, "code": status}}


def error_json(status: int, message: str, err_type: str | None = None, param: str | None = None) -> str:
    return json.dumps(openai_error(status, message, err_type, param))
