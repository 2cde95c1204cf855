"""The nccl backend of pair channels (llumnix/engine/kv_transport_pair.py), GPU to GPU, without a
torch.distributed process group: a two-rank NCCL communicator per channel through vLLM's ctypes
binding (`vllm.distributed.device_communicators.pynccl_wrapper.NCCLLibrary`). The destination engine
creates the `ncclUniqueId` (OpenChannel); it reaches the source engine over gRPC, in Propose's answer.
CUDA and NCCL are imported only when a channel is opened or joined; without CUDA it refuses clearly.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

from llumnix.engine.kv_transport import KVTransportError
from llumnix.v1.kv_transfer_pb2 import KVChannel

UNIQUE_ID_BYTES = 128


def require_cuda(device: Any = None) -> Any:
    """torch, when CUDA is there (and `device`, if given, is a CUDA device)."""
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        raise KVTransportError('the nccl KV channel needs a CUDA GPU on both engines; use "gloo" or "tcp"')
    return torch


def new_nccl_unique_id() -> bytes:
    require_cuda()
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


class NcclPair:
    """One two-rank communicator and a stream of its own on `device`."""

    def __init__(self, channel: KVChannel, rank: int, device: Any) -> None:
        torch = require_cuda(device)
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, ncclDataTypeEnum

        if len(channel.nccl_unique_id) != UNIQUE_ID_BYTES:
            raise KVTransportError(
                f"an ncclUniqueId has {UNIQUE_ID_BYTES} bytes, not {len(channel.nccl_unique_id)}")
        self._torch = torch
        current = torch.device("cuda", torch.cuda.current_device())
        self.device = current if device is None else torch.device(device)
        self._peer = 1 - rank
        self._lib = NCCLLibrary()
        self._uint8 = ncclDataTypeEnum.from_torch(torch.uint8)
        with torch.cuda.device(self.device):
            self._stream = torch.cuda.Stream(self.device)
            self._comm = self._lib.ncclCommInitRank(2, self._lib.unique_id_from_bytes(channel.nccl_unique_id),
                                                    rank)

    def send(self, flat: Any) -> None:
        self._lib.ncclSend(ctypes.c_void_p(flat.data_ptr()), flat.numel(), self._uint8, self._peer,
                           self._comm, ctypes.c_void_p(self._stream.cuda_stream))
        self._stream.synchronize()

    def recv(self, size: int) -> Any:
        flat = self._torch.empty(size, dtype=self._torch.uint8, device=self.device)
        if not size:
            return flat
        self._lib.ncclRecv(ctypes.c_void_p(flat.data_ptr()), size, self._uint8, self._peer, self._comm,
                           ctypes.c_void_p(self._stream.cuda_stream))
        self._stream.synchronize()
        return flat

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._lib.ncclCommDestroy(self._comm)
