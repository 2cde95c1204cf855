"""The NCCL (GPU to GPU) KV transport, without a torch.distributed process group: every source ->
destination engine pair gets its own two-rank NCCL communicator (vLLM's ctypes binding,
`vllm.distributed.device_communicators.pynccl_wrapper.NCCLLibrary`), created once and reused for
every later stage and migration between the two.

Control goes over TCP, in the frames of llumnix/engine/kv_transport.py, to the destination's `kv_address`:
1. the sender's first frame is a hello (stage 0, dtype `nccl-unique-id`) whose 128-byte payload is a
   fresh `ncclUniqueId`; the receiver acks it and both call `ncclCommInitRank` (receiver rank 0, sender
   rank 1). The id travels in-band, so the llumlets' Propose needs no transport parameters.
2. per stage: the header goes over TCP; the receiver checks the layout and answers a go-ahead ack (or a
   refusal: then nothing is sent on NCCL); the payload goes `ncclSend` -> `ncclRecv` into a device
   buffer on the receiver's GPU, which lands in the `StagingStore`; a final ack closes the stage.
CUDA and NCCL are imported only when this transport is built; without CUDA it refuses clearly.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import threading
from typing import Any

from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import (
    KV_FRAME_SCHEMA_VERSION,
    KVSender,
    KVTransportError,
    StageCallback,
    encode_message,
    parse_tcp_address,
    read_ack,
    recv_exact,
    recv_message,
    write_frame,
)
from llumnix.engine.kv_transport_tcp import TcpKVReceiver
from llumnix.v1.kv_transfer_pb2 import KVStageAck, KVStageHeader

HELLO_DTYPE = "nccl-unique-id"
_UNIQUE_ID_BYTES = 128
_RECEIVER_RANK, _SENDER_RANK = 0, 1


def _cuda() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise KVTransportError('the nccl KV transport needs a CUDA GPU; use transport "tcp" on this machine')
    return torch


class _Nccl:
    """One two-rank communicator and a stream of its own on `device`."""

    def __init__(self, device: Any, unique_id: bytes, rank: int) -> None:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, ncclDataTypeEnum

        torch = _cuda()
        self._torch = torch
        self.device = device
        self._lib = NCCLLibrary()
        self._uint8 = ncclDataTypeEnum.from_torch(torch.uint8)
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream(device)
            self._comm = self._lib.ncclCommInitRank(2, self._lib.unique_id_from_bytes(unique_id), rank)

    @staticmethod
    def new_unique_id() -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return bytes(NCCLLibrary().ncclGetUniqueId().internal)

    def send(self, flat: Any, peer: int) -> None:
        self._lib.ncclSend(ctypes.c_void_p(flat.data_ptr()), flat.numel(), self._uint8, peer, self._comm,
                           ctypes.c_void_p(self._stream.cuda_stream))
        self._stream.synchronize()

    def recv(self, size: int, peer: int) -> Any:
        flat = self._torch.empty(size, dtype=self._torch.uint8, device=self.device)
        if not size:
            return flat
        self._lib.ncclRecv(ctypes.c_void_p(flat.data_ptr()), size, self._uint8, peer, self._comm,
                           ctypes.c_void_p(self._stream.cuda_stream))
        self._stream.synchronize()
        return flat

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._lib.ncclCommDestroy(self._comm)


class NcclKVSender(KVSender):
    """Source side for one destination. The payload is a flat uint8 CUDA tensor; the communicator is
    built on the first send, on that tensor's device."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        _cuda()
        self.address = address
        self.timeout_s = timeout_s
        self._endpoint = parse_tcp_address(address)
        self._sock: socket.socket | None = None
        self._nccl: _Nccl | None = None
        self._lock = threading.Lock()

    def _connect(self, device: Any) -> tuple[socket.socket, _Nccl]:
        try:
            sock = socket.create_connection(self._endpoint, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransportError(f"cannot connect to KV receiver {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        unique_id = _Nccl.new_unique_id()
        hello = KVStageHeader(schema_version=KV_FRAME_SCHEMA_VERSION, stage=0, dtype=HELLO_DTYPE,
                              payload_bytes=len(unique_id))
        try:
            write_frame(sock, hello, unique_id)
            ack = read_ack(sock)
        except OSError as exc:
            sock.close()
            raise KVTransportError(f"NCCL hello to {self.address} failed: {exc}") from exc
        if not ack.ok:
            sock.close()
            raise KVTransportError(f"{self.address} refused an NCCL pair: {ack.error}")
        # Collective with the receiver's own ncclCommInitRank, which it starts after its ack.
        return sock, _Nccl(device, unique_id, _SENDER_RANK)

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._nccl is not None:
            self._nccl.close()
        self._sock, self._nccl = None, None

    def send(self, header: KVStageHeader, payload: Any) -> KVStageAck:
        flat = payload.reshape(-1)
        if header.payload_bytes != flat.numel():
            raise ValueError(f"header says {header.payload_bytes} bytes, the payload has {flat.numel()}")
        with self._lock:
            if self._sock is None or self._nccl is None:
                self._sock, self._nccl = self._connect(flat.device)
            try:
                self._sock.sendall(encode_message(header))
                go = read_ack(self._sock)
                if go.ok:
                    if header.payload_bytes:
                        self._nccl.send(flat, _RECEIVER_RANK)
                    ack = read_ack(self._sock)
            except (OSError, ConnectionError) as exc:
                self._drop()
                raise KVTransportError(
                    f"stage {header.stage} of {header.migration_id} to {self.address} failed: {exc}"
                ) from exc
            if not go.ok:  # refused before anything went over NCCL: the pair stays usable
                raise KVTransportError(f"{self.address} refused stage {header.stage}: {go.error}")
            if not ack.ok:
                raise KVTransportError(f"{self.address} could not stage {header.stage}: {ack.error}")
            return ack

    def close(self) -> None:
        with self._lock:
            self._drop()


class NcclKVReceiver(TcpKVReceiver):
    """Destination side: the TCP receiver's accept loop, with payloads arriving over NCCL on `device`
    (default: the current CUDA device of the thread that builds it, i.e. the engine worker's)."""

    def __init__(self, host: str, port: int = 0, *, staging: StagingStore,
                 on_stage: StageCallback | None = None, device: Any = None) -> None:
        torch = _cuda()
        super().__init__(host, port, staging=staging, on_stage=on_stage)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device

    def _serve(self, conn: socket.socket) -> None:
        nccl: _Nccl | None = None
        try:
            hello = KVStageHeader.FromString(recv_message(conn))
            unique_id = bytes(recv_exact(conn, hello.payload_bytes))
            if hello.dtype != HELLO_DTYPE or len(unique_id) != _UNIQUE_ID_BYTES:
                conn.sendall(encode_message(self._ack(hello, "expected an NCCL hello as the first frame")))
                return
            conn.sendall(encode_message(self._ack(hello)))
            nccl = _Nccl(self.device, unique_id, _RECEIVER_RANK)
            while not self._stop.is_set():
                header = KVStageHeader.FromString(recv_message(conn))
                try:
                    self.staging.check_layout(header)
                except ValueError as exc:
                    conn.sendall(encode_message(self._ack(header, str(exc))))
                    continue  # nothing was sent on NCCL: the stream stays in step
                conn.sendall(encode_message(self._ack(header)))
                payload = nccl.recv(header.payload_bytes, _SENDER_RANK)  # zero bytes: an empty tensor
                self.staging.put(header, payload)
                if self._on_stage is not None:
                    self._on_stage(header)
                conn.sendall(encode_message(self._ack(header)))
        except (OSError, ConnectionError):
            return
        finally:
            if nccl is not None:
                nccl.close()
            with self._lock:
                self._connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

