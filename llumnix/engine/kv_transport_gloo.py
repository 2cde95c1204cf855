"""The gloo backend of pair channels (llumnix/engine/kv_transport_pair.py): torch.distributed
point-to-point over a two-rank `ProcessGroupGloo` built directly on a store, never the process-wide
default group (vLLM's own). The destination engine opens the TCP store; both ranks connect to it,
under a prefix of their channel id, only to find each other. Payloads are CPU tensors."""

from __future__ import annotations

import datetime
from typing import Any

from llumnix.engine.kv_transport import KVTransportError, parse_tcp_address
from llumnix.v1.kv_transfer_pb2 import KVChannel


def _distributed() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        raise KVTransportError("this torch has no gloo backend; use transport \"tcp\"")
    return dist


def gloo_available() -> bool:
    try:
        _distributed()
    except (ImportError, KVTransportError):
        return False
    return True


def open_store(host: str, timeout_s: float) -> tuple[Any, str]:
    """A TCP store serving on `host` (any free port) and its host:port; it serves while referenced."""
    dist = _distributed()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{host}:{store.port}"


class GlooPair:
    def __init__(self, channel: KVChannel, rank: int, local_host: str, timeout_s: float,
                 pin_memory: bool = False) -> None:
        """`pin_memory`: receive into page-locked memory (a CUDA cache loads it at the bus's speed)."""
        dist = _distributed()
        import torch

        self._torch = torch
        host, port = parse_tcp_address(channel.store_address)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(channel.channel_id + "/",
                                 dist.TCPStore(host, port, is_master=False, timeout=timeout))
        options = dist.ProcessGroupGloo._Options()
        # Bind where the peer can reach us (the control connection's local address), not wherever
        # the machine's hostname resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._timeout = timeout
        self._peer = 1 - rank
        self._pin_memory = pin_memory
        self._group = dist.ProcessGroupGloo(store, rank, 2, options)

    def send(self, flat: Any) -> None:
        self._group.send([flat.cpu()], self._peer, 0).wait()

    def recv(self, size: int) -> Any:
        flat = self._torch.empty(size, dtype=self._torch.uint8, pin_memory=self._pin_memory)
        if size:
            self._group.recv([flat], self._peer, 0).wait()
        return flat

    def close(self) -> None:
        self._group.shutdown()
