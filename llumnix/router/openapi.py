"""The router's OpenAPI document (`GET /openapi.json`): what the router accepts and answers.

It describes what the router itself checks (a JSON object; a prompt or messages; a positive integer
`max_tokens` within the service's limit; the priority field); every other field passes to the
engine, which validates it and whose 4xx comes back unchanged, so the request schemas allow
additional properties. Every error is OpenAI's shape. Fuzzed in CI with schemathesis
(tests/integration/test_router_fuzz.py)."""

from __future__ import annotations

from typing import Any

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


def openapi_document(model: str, limits: RequestLimits, priorities: PrioritySettings) -> dict[str, Any]:
    max_tokens: dict[str, Any] = {"type": "integer", "minimum": 1}
    if limits.max_tokens is not None:
        max_tokens["maximum"] = limits.max_tokens
    common: dict[str, Any] = {
        "model": {"type": "string", "enum": [model], "description": "the served model (another name: 404)"},
        "max_tokens": max_tokens,
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "return_token_ids": {"type": "boolean"},
        priorities.body_field: {"type": "string", "enum": sorted(PRIORITY_VALUES),
                                "description": "the router's priority (removed before the engine)"},
    }
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    completion = {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "properties": {**common, "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1},
        ]}},
    }
    chat = {
        "type": "object", "required": ["messages"], "additionalProperties": True,
        "properties": {**common, "max_completion_tokens": max_tokens, "messages": {
            "type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role", "content"], "additionalProperties": True,
                "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                               "content": {"type": "string"}}}}},
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
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": "string", "nullable": True},
                               "code": {"nullable": True}}}}}}},
    }
