"""The engine <-> engine KV data plane of live migration, its interface: the source engine's `KVSender`
sends each stage (a `KVStageHeader` and the stage's KV transfer buffer, see llumnix/engine/kv_blocks.py)
to the destination engine's `KVReceiver`, which keeps it in a `StagingStore` (llumnix/engine/kv_staging.py)
until the migrated request is loaded.

Frame (proto/llumnix/v1/kv_transfer.proto): a 4-byte big-endian length, the serialized header, then
header.payload_bytes raw bytes; the answer is a length-prefixed `KVStageAck`. Nothing is pickled.
The TCP transport sends whole frames (llumnix/engine/kv_transport_tcp.py); the pair channels (gloo,
nccl: llumnix/engine/kv_transport_pair.py) send headers and acks this way and payloads over a two-rank
channel the destination opened; llumnix/engine/kv_transport_factory.py picks one by name.
"""

from __future__ import annotations

import abc
import dataclasses
import socket
import struct
from collections.abc import Callable
from typing import Any

from llumnix.v1.kv_transfer_pb2 import KVStageAck, KVStageHeader

KV_FRAME_SCHEMA_VERSION = 1
_LENGTH = struct.Struct(">I")
# A header or ack is a few dozen bytes; anything larger is a peer speaking another protocol.
_MAX_MESSAGE = 1 << 16

Payload = bytes | bytearray | memoryview
StageCallback = Callable[[KVStageHeader], None]


class KVTransportError(RuntimeError):
    """A stage could not be delivered (connection refused or lost, timeout, refusal by the receiver)."""


class KVSender(abc.ABC):
    """Source side, for one destination engine. `send` blocks (call it from a sender thread)."""

    @abc.abstractmethod
    def send(self, header: KVStageHeader, payload: Any) -> KVStageAck: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Destination side: accepts stages into a `StagingStore`; `address` is what peers send to, and
    only frames carrying their migration's key (derived from `kv_secret`) get in."""

    address: str
    kv_secret: str

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------- framing


@dataclasses.dataclass(frozen=True)
class KVStageFrame:
    header: KVStageHeader
    payload: Payload


def encode_message(message: KVStageHeader | KVStageAck) -> bytes:
    """Length prefix + serialized message (the header part of a frame, or a whole ack)."""
    body = message.SerializeToString()
    return _LENGTH.pack(len(body)) + body


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    """`size` bytes. MSG_WAITALL lets the kernel gather a whole payload in one call: each call returns
    through the engine process's GIL, which its model thread holds between steps' ops, so a payload
    read in 64 KiB pieces waited for the GIL once per piece."""
    buffer = bytearray(size)
    recv_into_exact(sock, memoryview(buffer))
    return buffer


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills the writable `view` from `sock` (see `recv_exact`)."""
    size, received = len(view), 0
    while received < size:
        count = sock.recv_into(view[received:], size - received, socket.MSG_WAITALL)
        if count == 0:
            raise ConnectionError(f"peer closed the connection after {received} of {size} bytes")
        received += count


def recv_message(sock: socket.socket) -> bytes:
    (size,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if size > _MAX_MESSAGE:
        raise ConnectionError(f"message of {size} bytes exceeds {_MAX_MESSAGE}: not a KV stage peer")
    return bytes(recv_exact(sock, size))



def read_frame(sock: socket.socket) -> KVStageFrame:
    """One frame; the payload lands in a single buffer allocated for it."""
    header = KVStageHeader.FromString(recv_message(sock))
    return KVStageFrame(header, recv_exact(sock, header.payload_bytes))


def read_ack(sock: socket.socket) -> KVStageAck:
    return KVStageAck.FromString(recv_message(sock))


def write_frame(sock: socket.socket, header: KVStageHeader, payload: Payload) -> None:
    """Header and payload in one `sendmsg` where possible; the payload is never copied."""
    view = memoryview(payload).cast("B")
    if header.payload_bytes != view.nbytes:
        raise ValueError(f"header says {header.payload_bytes} payload bytes, the payload has {view.nbytes}")
    prefix = encode_message(header)
    sent = sock.sendmsg([prefix, view])
    if sent < len(prefix):
        sock.sendall(memoryview(prefix)[sent:])
        sent = len(prefix)
    if sent - len(prefix) < view.nbytes:
        sock.sendall(view[sent - len(prefix):])


def parse_tcp_address(address: str) -> tuple[str, int]:
    """`tcp://host:port` or `host:port` -> (host, port)."""
    hostport = address.removeprefix("tcp://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"KV address {address!r} is not tcp://host:port")
    return host.strip("[]"), int(port)

