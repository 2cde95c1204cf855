"""Parsing and validation of the sim engine's OpenAI requests, answering bad input the way vLLM
0.32 does: type errors in pydantic's wording (`"type": "Bad Request"`, `param` = `body.<field>`),
value errors in vLLM's (`"type": "BadRequestError"`, `param` = the field), an unknown model 404."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llumnix.openai_stream import COMPLETION_DEFAULT_MAX_TOKENS, EndpointKind, openai_error
from llumnix.sim_engine.tokens import VOCAB_SIZE, apply_chat_template, encode

MAX_STOP_STRINGS = 4
MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")

# Fields that change the response's shape or meaning and that the sim engine does not model: they
# are refused rather than silently ignored (value -> whether the given value is the harmless default).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: not v,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None,
    "prompt_logprobs": lambda v: v is None,
    "use_beam_search": lambda v: not v,
    "suffix": lambda v: v is None,
    "tools": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "structured_outputs": lambda v: v is None,
    "prompt_embeds": lambda v: v is None,
}


class RequestError(Exception):
    """A request the engine refuses; `body` is the OpenAI error JSON."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = openai_error(status, message, err_type, param)


def _summary(value: Any) -> str:
    """How pydantic's messages (as vLLM prints them) show an offending input."""
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    return str(value)


def type_error(loc: str, kind: str, msg: str, value: Any) -> RequestError:
    detail = {"type": kind, "loc": f"body{'.' + loc if loc else ''}", "msg": msg, "input": _summary(value)}
    return RequestError(400, f"1 validation error:\n  {detail!r}", "Bad Request", detail["loc"])


def value_error(message: str, param: str | None = None, value: Any = None) -> RequestError:
    """vLLM's `VLLMValidationError`: the message names the parameter (and value) when it has one."""
    if param is not None:
        suffix = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
        message = f"{message} ({suffix})"
    return RequestError(400, message, "BadRequestError", param)


def _unsupported(field: str) -> RequestError:
    return RequestError(
        400,
        f"'{field}' is not supported by the simulated engine (llumnix sim-engine)",
        "BadRequestError",
        field,
    )


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated request, in engine terms."""

    endpoint: EndpointKind
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    """Already limited to the context left after the prompt."""
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    """Salts the prompt's prefix-cache blocks (vLLM's: only requests with the same salt share them)."""


class _Body:
    """Typed reads of the request's fields; absent and null fields give the default."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise type_error(
                "",
                "model_attributes_type",
                "Input should be a valid dictionary or object to extract fields from",
                raw,
            )
        self.raw = raw

    def integer(self, name: str, default: int | None) -> int | None:
        value = self.raw.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise type_error(name, "int_parsing", "Input should be a valid integer", value)
        return value

    def number(self, name: str) -> float | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise type_error(name, "float_parsing", "Input should be a valid number", value)
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.raw.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise type_error(name, "bool_type", "Input should be a valid boolean", value)
        return value

    def mapping(self, name: str) -> dict[str, Any] | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, dict):
            raise type_error(name, "dict_type", "Input should be a valid dictionary", value)
        return value

    def string(self, name: str) -> str | None:
        value = self.raw.get(name)
        if value is not None and not isinstance(value, str):
            raise type_error(name, "string_type", "Input should be a valid string", value)
        return value


def parse_request(
    endpoint: EndpointKind, raw: Any, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validates an OpenAI request body; raises `RequestError` with vLLM's answer to bad input."""
    body = _Body(raw)
    model = body.string("model")
    if model is not None and model != served_model:
        raise RequestError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {served_model}.",
            "NotFoundError",
            "model",
        )
    for field, harmless in _UNSUPPORTED.items():
        if not harmless(raw.get(field)):
            raise _unsupported(field)
    n = body.integer("n", 1)
    if n is not None and n < 1:
        raise value_error(f"n must be at least 1, got {n}.")
    if n != 1:
        raise _unsupported("n")

    prompt_ids = _prompt_ids(body) if endpoint is EndpointKind.COMPLETION else _chat_prompt_ids(body)
    bad = next((t for t in prompt_ids if not 0 <= t < VOCAB_SIZE), None)
    if bad is not None:
        raise value_error(f"Token id {bad} is out of vocabulary")
    if len(prompt_ids) > max_model_len:
        raise value_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(prompt_ids)} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            len(prompt_ids),
        )

    if endpoint is EndpointKind.CHAT:
        requested = body.integer("max_completion_tokens", None)
        if requested is None:
            requested = body.integer("max_tokens", None)
    else:
        requested = body.integer("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    if requested is not None and requested > max_model_len:
        raise value_error(
            f"max_tokens={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            "max_tokens",
            requested,
        )
    room = max_model_len - len(prompt_ids)
    max_tokens = room if requested is None else min(requested, room)
    if max_tokens < 1:
        raise value_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = body.integer("min_tokens", 0) or 0
    if min_tokens < 0:
        raise value_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise value_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    temperature = body.number("temperature")
    if temperature is not None and temperature < 0:
        raise value_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)

    stream = body.flag("stream")
    stream_options = body.mapping("stream_options")
    if stream_options is not None and not stream:
        raise value_error("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage"))
    return GenerationRequest(
        endpoint=endpoint,
        prompt_token_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(raw.get("stop")),
        stop_token_ids=frozenset(_int_list(raw.get("stop_token_ids"), "stop_token_ids")),
        include_stop_str_in_output=body.flag("include_stop_str_in_output"),
        ignore_eos=body.flag("ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=body.flag("return_token_ids"),
        priority=body.integer("priority", 0) or 0,
        kv_transfer_params=body.mapping("kv_transfer_params"),
        cache_salt=_cache_salt(raw.get("cache_salt")),
    )


def _cache_salt(value: Any) -> str | None:
    """vLLM's `validate_cache_salt`."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise value_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(value) > MAX_CACHE_SALT_LENGTH or any(char in CACHE_SALT_FORBIDDEN_CHARS for char in value):
        raise value_error("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                          "'@', '/', '\\\\', or NUL.", "cache_salt")
    return value


def _int_list(value: Any, loc: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise type_error(loc, "list_type", "Input should be a valid list", value)
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise type_error(f"{loc}.{i}", "int_type", "Input should be a valid integer", item)
    return value


def _prompt_ids(body: _Body) -> list[int]:
    prompt = body.raw.get("prompt")
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list):
        if any(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) == 1:
                return _prompt_ids(_Body({"prompt": prompt[0]}))
            raise RequestError(
                400,
                "a batch of prompts is not supported by the simulated engine "
                "(llumnix sim-engine); send one prompt per request",
                "BadRequestError",
                "prompt",
            )
        ids = _int_list(prompt, "prompt")
    elif prompt is None:
        ids = []
    else:
        raise type_error("prompt", "string_type", "Input should be a valid string", prompt)
    if not ids:
        raise value_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    return ids


def _chat_prompt_ids(body: _Body) -> list[int]:
    messages = body.raw.get("messages")
    if not isinstance(messages, list):
        raise type_error("messages", "list_type", "Input should be a valid list", messages)
    if not messages:
        raise value_error(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise type_error(f"messages.{i}", "dict_type", "Input should be a valid dictionary", message)
        if not isinstance(message.get("role"), str):
            raise type_error(f"messages.{i}.role", "missing", "Field required", message)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise type_error(
                f"messages.{i}.content", "string_type", "Input should be a valid string", content
            )
    return encode(apply_chat_template(messages))


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise type_error("stop", "string_type", "Input should be a valid string", value)
    if len(value) > MAX_STOP_STRINGS:
        raise type_error(
            "stop",
            "too_long",
            f"List should have at most {MAX_STOP_STRINGS} items after validation, not {len(value)}",
            value,
        )
    return tuple(s for s in value if s)
