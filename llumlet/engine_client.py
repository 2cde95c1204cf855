"""HTTP client for the engine's OpenAI server (vLLM or the sim engine) next to the llumlet."""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from llumnix.openai_stream import EndpointKind, openai_error

_KEEPALIVE_S = 2.0
"""Shorter than the engine's (uvicorn closes idle connections after 5 s): reusing a connection the
server is closing resets the request."""
_JSON = {"Content-Type": "application/json"}
_READ_BUFFER_BYTES = 4 << 20
"""Stream lines can be long (the first chunk carries every prompt token id)."""


class EngineHealth(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    """Refused the connection or answered /health with an error."""
    SLOW = "slow"
    """No answer within the timeout: a busy CPU engine looks like this, and so does a hung one."""


class EngineError(Exception):
    """The engine refused or failed a request; `body` is the OpenAI error JSON to pass on."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        super().__init__(str((body.get("error") or {}).get("message") or body))


class EngineUnavailableError(EngineError):
    """The engine could not be reached or dropped the connection."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(status, openai_error(status, message, "EngineUnavailable"))


class EngineClient:
    def __init__(self, base_url: str, request_timeout_s: float = 3600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5.0)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: every admitted request holds one stream to the engine.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, read_bufsize=_READ_BUFFER_BYTES,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open_stream(self, endpoint: EndpointKind, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """Sends a streaming request; raises `EngineError` unless the engine accepted it."""
        try:
            response = await self.session.post(self.base_url + endpoint.path, data=orjson.dumps(body),
                                               headers=_JSON)
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailableError(f"engine at {self.base_url} is unreachable: {exc}") from None
        if response.status != 200:
            raise await _error_from_response(response)
        return response

    @staticmethod
    async def iter_events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        """The stream's JSON events until `[DONE]`; an `{"error": ...}` event raises `EngineError`."""
        pending = b""
        try:
            # Whatever arrived at once, split into lines here: one await per read, not per line.
            async for data in response.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                for raw_line in lines:
                    line = raw_line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    event = orjson.loads(payload)
                    if "error" in event:
                        error = event["error"] if isinstance(event["error"], dict) else {}
                        raise EngineError(int(error.get("code") or 500), event)
                    yield event
        except (aiohttp.ClientError, OSError) as exc:
            # A response closed while read (a migration's final stage, an abort) raises aiohttp's one
            # module-level "Connection closed" error; every raise prepends its frames to that error's
            # traceback, so each closed stream's frames, response and buffers would live forever.
            exc.__traceback__ = None
            raise EngineUnavailableError(
                f"the engine dropped the response stream ({type(exc).__name__}); it may have died") from None
        except ValueError as exc:
            raise EngineUnavailableError(f"the engine sent an unreadable stream event: {exc}") from None
        finally:
            response.release()
        raise EngineUnavailableError("engine closed the stream before it finished")

    async def health(self, timeout_s: float) -> EngineHealth:
        try:
            async with self.session.get(self.base_url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return EngineHealth.HEALTHY if response.status == 200 else EngineHealth.UNHEALTHY
        except TimeoutError:
            return EngineHealth.SLOW
        except (aiohttp.ClientError, OSError):
            return EngineHealth.UNHEALTHY

    async def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes, str]:
        """Status, body and content type of a GET (for pass-through endpoints and /metrics)."""
        try:
            async with self.session.get(self.base_url + path,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return response.status, await response.read(), response.content_type
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineUnavailableError(f"engine at {self.base_url} is unreachable: {exc}") from None


async def _error_from_response(response: aiohttp.ClientResponse) -> EngineError:
    async with response:
        raw = await response.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        text = raw.decode(errors="replace").strip() or response.reason or "error"
        body = openai_error(response.status, f"engine answered {response.status}: {text}")
    return EngineError(response.status, body)
