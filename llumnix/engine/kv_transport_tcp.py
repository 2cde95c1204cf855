"""The TCP KV transport: whole frames (header, then payload) over one connection per source ->
destination engine pair, each acknowledged. `TcpKVReceiver` is also the accept loop of the pair
channels' receiver (llumnix/engine/kv_transport_pair.py), which serves their connections itself.

Only a negotiated migration gets in: every header must carry its migration's key (`migration_key` of
the receiver's own secret, which the destination's llumlet hands out in its answer to an authenticated
Propose). A frame without it is refused and its connection closed before the payload is read, so
nothing reaches staging."""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import struct
import threading
from typing import Any

from google.protobuf.message import DecodeError

from llumnix.engine.handshake import migration_key, new_kv_secret
from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import (
    KVReceiver,
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
from llumnix.v1.kv_transfer_pb2 import KVStageAck, KVStageHeader

log = logging.getLogger("vllm.llumnix")

# A refused frame's payload up to this size is read and discarded, keeping the connection.
_MAX_SKIP = 1 << 30


def _skip(sock: socket.socket, size: int) -> None:
    scratch = bytearray(min(size, 1 << 20))
    while size:
        count = sock.recv_into(scratch, min(size, len(scratch)))
        if count == 0:
            raise ConnectionError("peer closed the connection inside a payload")
        size -= count



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
        kv_secret: str | None = None,
    ) -> None:
        """`kv_secret`: what migration keys derive from (None: a fresh one, what an engine wants)."""
        self.staging = staging
        self._on_stage = on_stage
        self._listener = socket.create_server((host, port), reuse_port=False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = f"tcp://{bound_host}:{bound_port}"
        self.kv_secret = kv_secret or new_kv_secret()
        """Published in the engine's handshake record, which stays in its pod."""
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
            self._serve_connection(conn, KVStageHeader.FromString(recv_message(conn)))
        except (OSError, ConnectionError, DecodeError):  # a peer gone, or bytes that are no frame
            return
        finally:
            with self._lock:
                self._connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def admits(self, header: KVStageHeader) -> bool:
        """Whether the frame carries its migration's key (compared in constant time)."""
        return hmac.compare_digest(header.kv_key, migration_key(self.kv_secret, header.migration_id))

    def refuse(self, conn: socket.socket, header: KVStageHeader) -> None:
        """Answers a frame without its migration's key; the caller closes the connection."""
        log.warning("llumnix KV receiver: refused a frame for migration %r without its key from %s",
                    header.migration_id, conn.getpeername()[0])
        conn.sendall(encode_message(self._ack(header, "not a negotiated migration: wrong or missing kv_key")))

    def _serve_connection(self, conn: socket.socket, header: KVStageHeader) -> None:
        """Serves a connection from its first header on; here every frame carries its payload."""
        if header.HasField("channel"):
            conn.sendall(encode_message(self._ack(
                header, f"this receiver takes KV over tcp only, not {header.channel.backend}")))
            return
        while self._stage_frame(conn, header) and not self._stop.is_set():
            header = KVStageHeader.FromString(recv_message(conn))

    def _stage_frame(self, conn: socket.socket, header: KVStageHeader) -> bool:
        """Reads the payload after `header`, stages and acknowledges it; False: the connection ends."""
        if not self.admits(header):
            self.refuse(conn, header)
            return False
        try:
            self.staging.check_layout(header)
        except ValueError as exc:
            # Read past the refused payload so the sender gets the refusal, not a reset; a payload too
            # big to skip ends the connection instead.
            if header.payload_bytes > _MAX_SKIP:
                conn.sendall(encode_message(self._ack(header, str(exc))))
                return False
            _skip(conn, header.payload_bytes)
            conn.sendall(encode_message(self._ack(header, str(exc))))
            return True
        self._store(header, self._receive_payload(conn, header.payload_bytes))
        conn.sendall(encode_message(self._ack(header)))
        return True

    def _receive_payload(self, conn: socket.socket, size: int) -> Any:
        """A frame's payload, as staging will hold it."""
        return recv_exact(conn, size)

    def _store(self, header: KVStageHeader, payload: Any) -> None:
        self.staging.put(header, payload)
        if self._on_stage is not None:
            self._on_stage(header)

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

