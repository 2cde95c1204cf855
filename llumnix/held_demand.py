"""The router -> control loop wire format (proto/llumnix/v1/router.proto): the requests a router holds
while every instance is busy, served at `HELD_DEMAND_PATH` to callers holding the service token, so
the autoscaler counts them (`llumnix.load.cluster_demand`'s `held_tokens`)."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import DecodeError

from llumnix.v1 import router_pb2

HELD_DEMAND_PATH = "/llumnix/v1/held-demand"
CONTENT_TYPE = "application/x-protobuf"


def held_demand_to_bytes(request_tokens: Iterable[int]) -> bytes:
    return router_pb2.HeldDemand(request_tokens=list(request_tokens)).SerializeToString()


def held_demand_from_bytes(body: bytes) -> list[int]:
    """The held requests' token counts; ValueError when `body` is not a HeldDemand message."""
    message = router_pb2.HeldDemand()
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise ValueError(f"not a HeldDemand message: {exc}") from None
    return list(message.request_tokens)
