"""Errors the router answers clients with, as OpenAI error bodies."""

from __future__ import annotations

import json
from typing import Any

from llumnix.openai_request import OpenAIRequestError


class RouterError(OpenAIRequestError):
    """A request the router refuses or could not complete."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(status, message, err_type, param)
        if body is not None:
            self.body = body
        self.retry_after_s = retry_after_s

    @classmethod
    def from_failure(cls, status: int, body_json: str) -> RouterError:
        """The llumlet's error: its status and OpenAI error JSON (the engine's 4xx included)."""
        try:
            body = json.loads(body_json)
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return cls(status, str(body["error"].get("message", body_json)), body=body)
        return cls(status, f"instance error ({status}): {body_json}")
