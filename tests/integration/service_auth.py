"""The service token the integration tests' llumlets require (`sim_pairs` starts them with it) and a
channel for the tests and fake llumlets that call them directly: every call on it presents the token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from llumnix.service_token import ServiceToken, call_metadata

SERVICE_TOKEN = ServiceToken.generate()


async def _present_token(continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                         request: Any) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *call_metadata(SERVICE_TOKEN))
    return await continuation(details._replace(metadata=metadata), request)


# A channel files each interceptor under the first kind it is, so one class per kind of call.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, *args: Any) -> Any:
        return await _present_token(*args)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, *args: Any) -> Any:
        return await _present_token(*args)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, *args: Any) -> Any:
        return await _present_token(*args)


def authenticated_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, interceptors=[_UnaryUnary(), _UnaryStream(), _StreamStream()])
