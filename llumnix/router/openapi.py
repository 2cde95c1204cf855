"""The router's OpenAPI document (`GET /openapi.json`): what the router accepts and answers.

It is exact for what the router itself checks: a JSON object; a prompt or messages; a positive
integer `max_tokens` / `max_completion_tokens` within the service's limit; the priority field (the
router's string, or vLLM's integer, passed on); and `stream`, `stream_options` and
`return_token_ids`, which the router and the llumlet consume instead of the engine and read as vLLM
does (its lax booleans, stream options only with `stream`). Fields the engine validates are given
their OpenAI types; whatever depends on the model (token ids within its vocabulary, a prompt within
its context, the part types and roles its chat template takes, batches, non-zero priorities without
priority scheduling) is the engine's 4xx, which comes back unchanged, and every other field passes to
the engine, so the request schemas allow additional properties. Every error is OpenAI's shape.
Fuzzed in CI with schemathesis, requests that follow it accepted and requests that break it refused
(tests/integration/test_router_fuzz.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llumnix.openai_request import BOOLEAN_STRINGS
from llumnix.router.client_request import PRIORITY_VALUES, PrioritySettings, RequestLimits

_ERROR = {"$ref": "#/components/schemas/Error"}
_ERROR_RESPONSE = {"content": {"application/json": {"schema": _ERROR}}}
_ERRORS = {
    "400": {"description": "The request is malformed or outside the service's limits", **_ERROR_RESPONSE},
    "401": {"description": "Missing or wrong API key (when the service has keys)", **_ERROR_RESPONSE},
    "404": {"description": "Unknown model (the engine's answer)", **_ERROR_RESPONSE},
    "413": {"description": "The body is larger than the service allows", **_ERROR_RESPONSE},
    "422": {"description": "A field the engine cannot process", **_ERROR_RESPONSE},
    "503": {"description": "Every instance is busy or the router is shutting down; retry after "
            "`Retry-After`", **_ERROR_RESPONSE},
}
_BOOLEAN = {"$ref": "#/components/schemas/Boolean"}


def _any_case(words: Iterable[str]) -> str:
    """An ECMA regex matching exactly these words in any letter case (JSON Schema has no flags)."""
    alternatives = ("".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in word)
                    for word in sorted(words))
    return f"^({'|'.join(alternatives)})$"


def _components() -> dict[str, Any]:
    return {
        "Boolean": {
            "description": "A boolean as vLLM reads it: true or false, 0 or 1, or one of the strings "
                           f"{', '.join(BOOLEAN_STRINGS)} in any case; null is unset",
            "anyOf": [{"type": "boolean", "nullable": True}, {"enum": [0, 1]},
                      {"type": "string", "pattern": _any_case(BOOLEAN_STRINGS)}]},
        "Error": {
            "type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": "string", "nullable": True},
                               "code": {"nullable": True}}}}},
    }


def openapi_document(model: str, limits: RequestLimits, priorities: PrioritySettings) -> dict[str, Any]:
    max_tokens: dict[str, Any] = {"type": "integer", "minimum": 1, "nullable": True}
    if limits.max_tokens is not None:
        max_tokens["maximum"] = limits.max_tokens
    common: dict[str, Any] = {
        "model": {"type": "string", "enum": [model], "nullable": True,
                  "description": "the served model (another name: 404)"},
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "checked like max_tokens on both endpoints "
                                  "(vLLM reads it for chat)"},
        "stream": _BOOLEAN,
        "stream_options": {"type": "object", "nullable": True, "additionalProperties": True,
                           "description": "unless empty, only with a `stream` that is not false (vLLM's "
                                          "rule, which reads the raw value)",
                           "properties": {"include_usage": _BOOLEAN, "continuous_usage_stats": _BOOLEAN}},
        "return_token_ids": _BOOLEAN,
        priorities.body_field: {
            "description": "the router's priority (removed before the engine; null is unset), or vLLM's "
                           "integer priority, passed on (non-zero needs the engine's priority scheduling)",
            "anyOf": [{"type": "string", "pattern": _any_case(PRIORITY_VALUES), "nullable": True},
                      {"type": "number", "multipleOf": 1}]},  # an integer; vLLM reads 2.0 as 2
    }
    # vLLM: stream options that are not empty only with a stream value that is not false.
    stream_options_rule = [
        {"properties": {"stream_options": {"type": "object", "nullable": True, "maxProperties": 0}}},
        {"required": ["stream"], "properties": {"stream": {"not": {"enum": [False, 0, None]}}}},
    ]
    text = {"type": "string", "minLength": 1}
    # Really below the model's vocabulary size, which the document does not know (the engine's 400);
    # beyond 64 bits the router's JSON reader makes a float of it.
    token_id = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    completion = {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "anyOf": stream_options_rule,
        "properties": {**common, "prompt": {
            "description": "a text, token ids, or a batch of either (the engine may limit batches)",
            "oneOf": [text, {"type": "array", "items": text, "minItems": 1}, token_ids,
                      {"type": "array", "items": token_ids, "minItems": 1}]}},
    }
    part = {"type": "object", "required": ["type"], "additionalProperties": True,
            "description": "{type: text, text}; other part types as the model supports them",
            "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
    parts = {"type": "array", "items": {"anyOf": [{"type": "string"}, part]}}
    message = {
        "type": "object", "required": ["role"], "additionalProperties": True,
        "description": "any role the model's chat template takes; content null only from the assistant",
        "properties": {"role": {"type": "string"}},
        "anyOf": [{"properties": {"content": {"anyOf": [{"type": "string"}, parts]}}},
                  {"properties": {"role": {"enum": ["assistant"]},
                                  "content": {"anyOf": [{"type": "string", "nullable": True}, parts]}}}],
    }
    chat = {
        "type": "object", "required": ["messages"], "additionalProperties": True,
        "anyOf": stream_options_rule,
        "properties": {**common, "messages": {"type": "array", "minItems": 1, "items": message}},
    }
    generated = {"200": {"description": "The completion (JSON), or its chunks as server-sent events when "
                         "`stream` is true", "content": {
                             "application/json": {"schema": {"type": "object"}},
                             # one server-sent event: a chunk's JSON, an error's, or [DONE]
                             "text/event-stream": {"schema": {
                                 "type": "object", "required": ["data"],
                                 "properties": {"data": {"type": "string"}}}}}}, **_ERRORS}
    plain = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "llumnix router", "version": "1",
                 "description": "OpenAI-compatible endpoint of one LLMService"},
        "paths": {
            "/v1/completions": {"post": {"operationId": "createCompletion", "requestBody": {
                "required": True, "content": {"application/json": {"schema": completion}}},
                "responses": generated}},
            "/v1/chat/completions": {"post": {"operationId": "createChatCompletion", "requestBody": {
                "required": True, "content": {"application/json": {"schema": chat}}},
                "responses": generated}},
            "/v1/models": {"get": {"operationId": "listModels",
                                   "responses": {"200": plain, "401": _ERRORS["401"]}}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": plain, "503": {"description": "No instance can take requests, or shutting down",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": _components()},
    }
