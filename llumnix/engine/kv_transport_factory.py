"""Picks a KV transport by name: "tcp" (the default, also for an empty name), or a pair channel
("gloo", "nccl"; llumnix/engine/kv_transport_pair.py) given the channel the destination opened, and
says which channels this engine can use. Importing it costs nothing without torch: the pair backends
load torch (and NCCL) only when a channel is built."""

from __future__ import annotations

from typing import Any

from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import KVSender, StageCallback
from llumnix.engine.kv_transport_pair import KVStageReceiver, PairKVSender, is_cuda
from llumnix.engine.kv_transport_tcp import TcpKVSender
from llumnix.v1.kv_transfer_pb2 import KVChannel

TRANSPORTS = ("tcp", "gloo", "nccl")


def available_channels(device: Any = None) -> list[str]:
    """The channels an engine whose KV cache is on `device` receives and sends on: tcp always, gloo
    where torch has it, nccl on a CUDA device (the handshake record's `kv_channels`)."""
    from llumnix.engine.kv_transport_gloo import gloo_available

    channels = ["tcp"]
    if gloo_available():
        channels.append("gloo")
    if is_cuda(device):
        channels.append("nccl")
    return channels


def make_sender(transport: str, address: str, timeout_s: float = 10.0,
                channel: KVChannel | None = None) -> KVSender:
    """A sender for `transport` to the receiver at `address`; a pair channel needs its `channel`."""
    if transport in ("", "tcp"):
        return TcpKVSender(address, timeout_s=timeout_s)
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
    if channel is None or channel.backend != transport:
        raise ValueError(f"a {transport} sender needs the {transport} channel the destination opened")
    return PairKVSender(address, channel, timeout_s=timeout_s)


def make_receiver(*, host: str, port: int = 0, staging: StagingStore, on_stage: StageCallback | None = None,
                  device: Any = None, timeout_s: float = 10.0, kv_secret: str | None = None
                  ) -> KVStageReceiver:
    """The engine's receiver for every channel (tcp frames, pair channels), not yet started; it admits
    only frames with their migration's key (`kv_secret` None: a fresh secret)."""
    return KVStageReceiver(host, port, staging=staging, on_stage=on_stage, device=device, timeout_s=timeout_s,
                           kv_secret=kv_secret)
