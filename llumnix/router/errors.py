"""Errors the router answers clients with, as OpenAI error bodies."""

from __future__ import annotations

import json
from typing import Any

import grpc

from llumnix.openai_request import OpenAIRequestError

_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class RouterError(OpenAIRequestError):
    """A request the router refuses or could not complete."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(status, message, err_type, param)
        if body is not None:
            self.body = body
        self.retry_after_s = retry_after_s

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError) -> RouterError:
        """The llumlet's error: its details are the OpenAI error JSON (the engine's 4xx included)."""
        status = _STATUS_OF_CODE.get(exc.code(), 500)
        details = exc.details() or ""
        try:
            body = json.loads(details)
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
            if isinstance(code, int) and 400 <= code < 600:
                status = code
            return cls(status, str(body["error"].get("message", details)), body=body)
        return cls(status, f"instance error ({exc.code().name}): {details}")
