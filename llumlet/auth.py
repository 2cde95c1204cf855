"""The llumlet lets in only callers that present the service token (llumnix/service_token.py): every
gRPC method (a server interceptor: UNAUTHENTICATED otherwise) and the HTTP front's OpenAI API (401 in
OpenAI's error shape). /health and /metrics stay open: the kubelet's probes and Prometheus carry no
token, and neither path reveals a prompt or takes a command."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from llumnix.service_token import AUTHORIZATION_METADATA, ServiceToken

logger = logging.getLogger("llumlet.auth")

OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
REFUSAL = "missing or wrong service token: send 'authorization: Bearer <token>'"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _presented(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA:
            return value if isinstance(value, str) else None
    return None


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call before reading a message."""
    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(_refuse, **serializers)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every method of the server it is installed on requires the token."""

    def __init__(self, token: ServiceToken) -> None:
        self.token = token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.token.accepts(_presented(handler_call_details.invocation_metadata)):
            return handler
        logger.warning("refused an unauthenticated gRPC call", extra={"method": handler_call_details.method})
        return _refusing(handler)


def http_middleware(token: ServiceToken) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_HTTP_PATHS or token.accepts(request.headers.get("Authorization")):
            return await handler(request)
        logger.warning("refused an unauthenticated HTTP request", extra={"path": request.path})
        return web.json_response({"error": {"message": REFUSAL, "type": "invalid_request_error",
                                            "param": None, "code": "invalid_api_key"}}, status=401)

    return require_token
