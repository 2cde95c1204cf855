"""Picks a KV transport by name: "tcp" (the default, also for an empty name) or "nccl". Importing the
NCCL module costs nothing on a machine without CUDA: it loads torch and NCCL only when one is built."""

from __future__ import annotations

from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import KVReceiver, KVSender, StageCallback
from llumnix.engine.kv_transport_nccl import NcclKVReceiver, NcclKVSender
from llumnix.engine.kv_transport_tcp import TcpKVReceiver, TcpKVSender

TRANSPORTS = ("tcp", "nccl")


def make_sender(transport: str, address: str, timeout_s: float = 10.0) -> KVSender:
    """A sender for `transport` ("tcp" or "nccl"; empty means tcp) to the receiver at `address`."""
    if transport in ("", "tcp"):
        return TcpKVSender(address, timeout_s=timeout_s)
    if transport == "nccl":
        return NcclKVSender(address, timeout_s=timeout_s)
    raise ValueError(f"unknown KV transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")


def make_receiver(
    transport: str,
    *,
    host: str,
    port: int = 0,
    staging: StagingStore,
    on_stage: StageCallback | None = None,
) -> KVReceiver:
    """A receiver for `transport`, not yet started."""
    if transport in ("", "tcp"):
        return TcpKVReceiver(host, port, staging=staging, on_stage=on_stage)
    if transport == "nccl":
        return NcclKVReceiver(host, port, staging=staging, on_stage=on_stage)
    raise ValueError(f"unknown KV transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
