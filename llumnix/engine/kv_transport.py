"""The engine <-> engine KV data plane of live migration: the source engine's `KVSender` sends each stage
(a `KVStageHeader` and the stage's KV transfer buffer, see llumnix/engine/kv_blocks.py) to the destination
engine's `KVReceiver`, which keeps it in a `StagingStore` until the migrated request is loaded.

TCP frame (proto/llumnix/v1/kv_transfer.proto): a 4-byte big-endian length, the serialized header,
then header.payload_bytes raw bytes; the answer is a length-prefixed `KVStageAck`. Nothing is pickled.
The NCCL transport (GPU to GPU) lives in llumnix/engine/kv_transport_nccl.py and is imported only
when asked for.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from llumnix.v1.kv_transfer_pb2 import KVStageAck, KVStageHeader

KV_FRAME_SCHEMA_VERSION = 1
TRANSPORTS = ("tcp", "nccl")
_LENGTH = struct.Struct(">I")
# A header or ack is a few dozen bytes; anything larger is a peer speaking another protocol.
_MAX_MESSAGE = 1 << 16
# A refused frame's payload up to this size is read and discarded, keeping the connection.
_MAX_SKIP = 1 << 30

Payload = bytes | bytearray | memoryview
StageCallback = Callable[[KVStageHeader], None]


class KVTransportError(RuntimeError):
    """A stage could not be delivered (connection refused or lost, timeout, refusal by the receiver)."""


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
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received, socket.MSG_WAITALL)
        if count == 0:
            raise ConnectionError(f"peer closed the connection after {received} of {size} bytes")
        received += count
    return buffer


def recv_message(sock: socket.socket) -> bytes:
    (size,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if size > _MAX_MESSAGE:
        raise ConnectionError(f"message of {size} bytes exceeds {_MAX_MESSAGE}: not a KV stage peer")
    return bytes(recv_exact(sock, size))


def _skip(sock: socket.socket, size: int) -> None:
    scratch = bytearray(min(size, 1 << 20))
    while size:
        count = sock.recv_into(scratch, min(size, len(scratch)))
        if count == 0:
            raise ConnectionError("peer closed the connection inside a payload")
        size -= count


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


# ---------------------------------------------------------------------------------------- staging


@dataclasses.dataclass
class _Migration:
    blocks: dict[int, Any] = dataclasses.field(default_factory=dict)  # logical index -> block bytes
    num_tokens: int = 0
    stages: int = 0
    touched_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class StagedKV:
    """The staged blocks of one migration, taken out of the store for loading."""

    migration_id: str
    num_tokens: int
    bytes_per_block: int
    block_data: dict[int, Any]

    def blocks(self, first: int, last: int) -> Any:
        """Blocks [first, last) as one contiguous buffer (a bytearray; a tensor for device payloads),
        ready for `KVBlockCopier.copy_in` once viewed as its layout. KeyError names a missing block."""
        missing = [index for index in range(first, last) if index not in self.block_data]
        if missing:
            raise KeyError(f"migration {self.migration_id}: blocks {missing} were never staged")
        parts = [self.block_data[index] for index in range(first, last)]
        if parts and not isinstance(parts[0], memoryview):
            import torch  # device payloads (NCCL) are tensors; torch is loaded wherever those exist

            return torch.cat(parts)
        buffer = bytearray(self.bytes_per_block * (last - first))
        for offset, part in enumerate(parts):
            start = offset * self.bytes_per_block
            buffer[start:start + self.bytes_per_block] = part
        return buffer


class StagingStore:
    """Destination-side staging, per migration id: logical block index -> bytes of that block (later
    stages overwrite the re-sent tail block), tokens staged. A migration untouched for `lease_s` is
    dropped by `expire`, so no staging outlives a failed migration, even one whose llumlet died."""

    def __init__(self, bytes_per_block: int, dtype: str, lease_s: float = 60.0) -> None:
        self.bytes_per_block = bytes_per_block
        self.dtype = dtype
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._migrations: dict[str, _Migration] = {}

    def check_layout(self, header: KVStageHeader) -> None:
        """ValueError unless the frame's schema, layout and size match this engine's KV layout."""
        if header.schema_version != KV_FRAME_SCHEMA_VERSION:
            raise ValueError(f"KV frame schema {header.schema_version} is not {KV_FRAME_SCHEMA_VERSION}")
        if header.bytes_per_block != self.bytes_per_block or header.dtype != self.dtype:
            raise ValueError(
                f"KV layout mismatch: frame has {header.bytes_per_block} bytes/block {header.dtype}, "
                f"this engine {self.bytes_per_block} bytes/block {self.dtype}"
            )
        if header.payload_bytes != header.num_blocks * self.bytes_per_block:
            raise ValueError(
                f"frame carries {header.payload_bytes} bytes for {header.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes"
            )

    def put(self, header: KVStageHeader, payload: Any, now: float | None = None) -> int:
        """Stores a stage's blocks (a bytes-like payload, or a flat uint8 tensor); returns tokens staged."""
        self.check_layout(header)
        size = self.bytes_per_block
        is_bytes = isinstance(payload, bytes | bytearray | memoryview)
        data = memoryview(payload).cast("B") if is_bytes else payload
        if len(data) != header.payload_bytes:
            raise ValueError(f"payload has {len(data)} bytes, the header says {header.payload_bytes}")
        with self._lock:
            entry = self._migrations.setdefault(header.migration_id, _Migration())
            for offset in range(header.num_blocks):
                entry.blocks[header.first_block + offset] = data[offset * size:(offset + 1) * size]
            entry.num_tokens = max(entry.num_tokens, header.num_tokens)
            entry.stages += 1
            entry.touched_at = time.monotonic() if now is None else now
            return entry.num_tokens

    def staged_tokens(self, migration_id: str) -> int:
        with self._lock:
            entry = self._migrations.get(migration_id)
            return entry.num_tokens if entry else 0

    def take(self, migration_id: str) -> StagedKV | None:
        """Removes and returns a migration's staging (None when absent or expired)."""
        with self._lock:
            entry = self._migrations.pop(migration_id, None)
        if entry is None:
            return None
        return StagedKV(migration_id, entry.num_tokens, self.bytes_per_block, entry.blocks)

    def drop(self, migration_id: str) -> bool:
        with self._lock:
            return self._migrations.pop(migration_id, None) is not None

    def expire(self, now: float | None = None) -> list[str]:
        """Drops migrations untouched for lease_s; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [
                key for key, entry in self._migrations.items() if now - entry.touched_at >= self.lease_s
            ]
            for key in expired:
                del self._migrations[key]
        return expired

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self.bytes_per_block * sum(len(entry.blocks) for entry in self._migrations.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._migrations)


# ---------------------------------------------------------------------------------------- interfaces


class KVSender(abc.ABC):
    """Source side, for one destination engine. `send` blocks (call it from a sender thread)."""

    @abc.abstractmethod
    def send(self, header: KVStageHeader, payload: Any) -> KVStageAck: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Destination side: accepts stages into a `StagingStore`; `address` is what peers send to."""

    address: str

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------- TCP


class TcpKVSender(KVSender):
    """One connection per destination, kept across stages and migrations. A failure on a reused
    connection (the receiver restarted) is retried once on a fresh one: re-sending a stage is
    harmless because staging overwrites blocks by index."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._endpoint = parse_tcp_address(address)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._endpoint, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransportError(f"cannot connect to KV receiver {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocking socket with kernel timeouts: a frame goes out in one send call (a Python-level
        # timeout makes the socket non-blocking, and every partial send then waits for the GIL again).
        sock.settimeout(None)
        seconds, fraction = divmod(self.timeout_s, 1.0)
        limit = struct.pack("ll", int(seconds), int(fraction * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        return sock

    def _drop_connection(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def send(self, header: KVStageHeader, payload: Any) -> KVStageAck:
        with self._lock:
            for attempt in (1, 2):
                reused = self._sock is not None
                if self._sock is None:
                    self._sock = self._connect()
                try:
                    write_frame(self._sock, header, payload)
                    ack = read_ack(self._sock)
                    break
                except (OSError, ConnectionError) as exc:
                    self._drop_connection()
                    if reused and attempt == 1:
                        continue
                    # The kernel's send/receive timeout surfaces as EAGAIN.
                    timed_out = isinstance(exc, BlockingIOError)
                    reason = f"timed out after {self.timeout_s:g} s" if timed_out else exc
                    raise KVTransportError(
                        f"stage {header.stage} of {header.migration_id} to {self.address} failed: {reason}"
                    ) from exc
            if not ack.ok:
                raise KVTransportError(f"{self.address} refused stage {header.stage}: {ack.error}")
            return ack

    def close(self) -> None:
        with self._lock:
            self._drop_connection()


class TcpKVReceiver(KVReceiver):
    """Accept thread + one thread per connection; every frame is stored and acknowledged. A frame
    whose layout does not match the store is refused (ok=false) and never written."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        staging: StagingStore,
        on_stage: StageCallback | None = None,
    ) -> None:
        self.staging = staging
        self._on_stage = on_stage
        self._listener = socket.create_server((host, port), reuse_port=False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = f"tcp://{bound_host}:{bound_port}"
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accept_thread = threading.Thread(target=self._accept, name="llumnix-kv-accept", daemon=True)

    def start(self) -> None:
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="llumnix-kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                header = KVStageHeader.FromString(recv_message(conn))
                try:
                    self.staging.check_layout(header)
                except ValueError as exc:
                    # Read past the refused payload so the sender gets the refusal, not a reset; a
                    # payload too big to skip ends the connection instead.
                    if header.payload_bytes > _MAX_SKIP:
                        conn.sendall(encode_message(self._ack(header, str(exc))))
                        return
                    _skip(conn, header.payload_bytes)
                    conn.sendall(encode_message(self._ack(header, str(exc))))
                    continue
                payload = recv_exact(conn, header.payload_bytes)
                self.staging.put(header, payload)
                if self._on_stage is not None:
                    self._on_stage(header)
                conn.sendall(encode_message(self._ack(header)))
        except (OSError, ConnectionError):
            return
        finally:
            with self._lock:
                self._connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    @staticmethod
    def _ack(header: KVStageHeader, error: str = "") -> KVStageAck:
        return KVStageAck(migration_id=header.migration_id, stage=header.stage, ok=not error, error=error)

    def close(self) -> None:
        self._stop.set()
        # shutdown wakes the thread blocked in accept(); close alone would leave the port listening.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._accept_thread.is_alive():
            self._accept_thread.join(timeout=5)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()


# ---------------------------------------------------------------------------------------- factories


def make_sender(transport: str, address: str, params_json: str = "", timeout_s: float = 10.0) -> KVSender:
    """A sender for `transport` ("tcp" or "nccl"; empty means tcp) to the receiver at `address`."""
    if transport in ("", "tcp"):
        return TcpKVSender(address, timeout_s=timeout_s)
    if transport == "nccl":
        from llumnix.engine.kv_transport_nccl import NcclKVSender

        return NcclKVSender(address, params_json, timeout_s=timeout_s)
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
        from llumnix.engine.kv_transport_nccl import NcclKVReceiver

        return NcclKVReceiver(host, port, staging=staging, on_stage=on_stage)
    raise ValueError(f"unknown KV transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
