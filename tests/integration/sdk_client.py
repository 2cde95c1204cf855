"""The `openai` SDK as the router tests use it: without its silent retries (a 5xx retried, or a request
held past the router's queue timeout and sent again, would hide the failure a test is there to see)
and with a bound that fails loudly instead of the SDK's ten minutes."""

from __future__ import annotations

import openai

REQUEST_TIMEOUT_S = 90.0
"""Longer than the router's queue timeout (60 s), so that a request the router holds too long fails
with the router's own 503 and its reason."""


def openai_client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """A client of the OpenAI API served at `url` (its `/v1`)."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
