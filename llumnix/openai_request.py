"""The OpenAI generation API as the llumnix HTTP fronts (llumlet, router, sim engine) serve it: the
routes, reading a request body and its stream fields, the checks every front makes before an engine
sees the body, and the prompt-length estimate the fronts use before an engine reports the exact
length."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from llumnix.openai_stream import EndpointKind, openai_error

BYTES_PER_TOKEN_ESTIMATE = 4
"""Text is estimated at this many UTF-8 bytes per token until `PromptSizer` has learnt the engine's
ratio (and each request's exact length is known once the engine reports it)."""

BOOLEAN_STRINGS = {"true": True, "t": True, "yes": True, "y": True, "on": True, "1": True,
                   "false": False, "f": False, "no": False, "n": False, "off": False, "0": False}
"""The strings vLLM (pydantic's lax mode) reads as a boolean, in any case."""
STREAM_OPTION_FLAGS = ("include_usage", "continuous_usage_stats")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GenerateHandler = Callable[[web.Request, EndpointKind], Awaitable[web.StreamResponse]]


class OpenAIRequestError(Exception):
    """A request refused before it reaches an engine; `body` is the OpenAI error JSON."""

    def __init__(self, status: int, message: str, err_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = openai_error(status, message, err_type, param)

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status)


def add_openai_routes(app: web.Application, generate: GenerateHandler, models: Handler, health: Handler,
                      metrics: Handler) -> web.Application:
    """`/v1/completions` and `/v1/chat/completions` (both to `generate`), `/v1/models`, `/health`,
    `/metrics`."""

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, EndpointKind.COMPLETION)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await generate(request, EndpointKind.CHAT)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def read_json_body(request: web.Request, max_bytes: int) -> Any:
    """The parsed body; 413 beyond `max_bytes` (the app's client_max_size), 400 if it is not JSON."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIRequestError(413, f"request body exceeds {max_bytes} bytes") from None
    try:
        # orjson refuses integers beyond 64 bits, which no field may hold (and which it could not
        # write again for the next hop).
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIRequestError(400, f"request body is not valid JSON: {exc}") from None


def check_generation_body(endpoint: EndpointKind, body: Any) -> dict[str, Any]:
    """A JSON object with a prompt (completions) or messages (chat); the engine validates the rest."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(400, "request body must be a JSON object")
    if endpoint is EndpointKind.COMPLETION:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise OpenAIRequestError(400, "'prompt' is required", param="prompt")
        if not isinstance(prompt, (str, list)):
            raise OpenAIRequestError(400, "'prompt' must be a string or a list", param="prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIRequestError(400, "'messages' must be a non-empty list", param="messages")
    return body


def lax_boolean(value: Any, param: str) -> bool | None:
    """A boolean field read as vLLM reads it (pydantic's lax mode): true or false, 0 or 1, or one of
    `BOOLEAN_STRINGS` in any case; null is unset. Anything else is a 400."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in BOOLEAN_STRINGS:
        return BOOLEAN_STRINGS[value.lower()]
    raise OpenAIRequestError(400, f"'{param}' must be a boolean", param=param)


def read_stream_fields(body: dict[str, Any]) -> None:
    """`stream`, `stream_options` and `return_token_ids` never reach the engine as the client sent
    them (the llumlet sets its own), so the fronts check them as vLLM would, and write them back as
    JSON booleans for everything after them that reads them."""
    # vLLM's own rule reads the raw value: any truthy `stream` (even "false") allows stream options.
    stream_given = bool(body.get("stream"))
    for key in ("stream", "return_token_ids"):
        if body.get(key) is not None:
            body[key] = lax_boolean(body[key], key)
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise OpenAIRequestError(400, "'stream_options' must be an object", param="stream_options")
    if options and not stream_given:
        raise OpenAIRequestError(400, "Stream options can only be defined when `stream=True`. "
                          "(parameter=stream_options)", param="stream_options")  # vLLM's words
    body["stream_options"] = {**options, **{
        key: lax_boolean(options[key], f"stream_options.{key}")
        for key in STREAM_OPTION_FLAGS if options.get(key) is not None}}


# One estimator for the llumlet's load and the router's in-flight accounting and limit. It is the
# router's former one (it counted the text parts of list content and batches of token-id lists, which
# the llumlet's missed) with the llumlet's sum over a batch, which is what the KV cache holds, and its
# floor of one token per prompt.
def prompt_token_estimates(endpoint: EndpointKind, body: dict[str, Any],
                           bytes_per_token: float = BYTES_PER_TOKEN_ESTIMATE) -> list[int]:
    """Each prompt's length in tokens, at least 1 (the engine runs every prompt through the model):
    token ids counted exactly, text estimated from its UTF-8 size. A chat request is one prompt, the
    text of all its messages including the text parts of list content (images and other parts are not
    estimated); a completion has one prompt per element of a batch (texts or token-id lists)."""
    if endpoint is EndpointKind.CHAT:
        return [_text_tokens(_chat_text(body), bytes_per_token)]
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and not all(isinstance(t, int) for t in prompt)
    return [_one_prompt_tokens(p, bytes_per_token) for p in (prompt if batch else [prompt])]


def estimate_prompt_tokens(endpoint: EndpointKind, body: dict[str, Any],
                           bytes_per_token: float = BYTES_PER_TOKEN_ESTIMATE) -> int:
    """All of a request's prompts together: what its prefill puts in the KV cache (each prompt of a
    batch completion is a sequence of its own)."""
    return sum(prompt_token_estimates(endpoint, body, bytes_per_token))


def text_prompt_bytes(endpoint: EndpointKind, body: dict[str, Any]) -> int | None:
    """The UTF-8 size of a request's one text prompt (a completion's string, a chat's message text);
    None where the prompt is token ids, a batch, or no text."""
    text = _chat_text(body) if endpoint is EndpointKind.CHAT else body.get("prompt")
    return len(text.encode("utf-8")) if isinstance(text, str) and text else None


class PromptSizer:
    """Text prompts' lengths as the engine counts them. The bytes per token are learnt from the exact
    lengths the engine reported for the last `window` text prompts (a byte-level tokenizer has 1, an
    English BPE about 4, a chat template adds its own tokens); `BYTES_PER_TOKEN_ESTIMATE` until
    `min_samples` are known. The router and the llumlet each keep one: until an engine lists a
    request with its exact length, their load accounting reads this estimate, and a 4x error puts two
    long prompts where only one fits."""

    MIN_BYTES_PER_TOKEN = 0.25
    MAX_BYTES_PER_TOKEN = 16.0

    def __init__(self, window: int = 128, min_samples: int = 4) -> None:
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)
        self._bytes = 0
        self._tokens = 0
        self.min_samples = min_samples

    @property
    def bytes_per_token(self) -> float:
        if len(self._samples) < self.min_samples:
            return BYTES_PER_TOKEN_ESTIMATE
        return min(self.MAX_BYTES_PER_TOKEN, max(self.MIN_BYTES_PER_TOKEN, self._bytes / self._tokens))

    def estimates(self, endpoint: EndpointKind, body: dict[str, Any]) -> list[int]:
        return prompt_token_estimates(endpoint, body, self.bytes_per_token)

    def learn(self, endpoint: EndpointKind, body: dict[str, Any], prompt_tokens: int) -> None:
        """The engine's exact prompt length for a request as the client sent it."""
        size = text_prompt_bytes(endpoint, body)
        if size is None or prompt_tokens < 1:
            return
        if len(self._samples) == self._samples.maxlen:
            old_bytes, old_tokens = self._samples[0]
            self._bytes -= old_bytes
            self._tokens -= old_tokens
        self._samples.append((size, prompt_tokens))
        self._bytes += size
        self._tokens += prompt_tokens


def _chat_text(body: dict[str, Any]) -> str:
    texts: list[str] = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return "".join(texts)


def _one_prompt_tokens(prompt: Any, bytes_per_token: float) -> int:
    if isinstance(prompt, list):
        return max(1, len(prompt))  # token ids
    return _text_tokens("" if prompt is None else str(prompt), bytes_per_token)


def _text_tokens(text: str, bytes_per_token: float) -> int:
    return max(1, math.ceil(len(text.encode("utf-8")) / bytes_per_token))
