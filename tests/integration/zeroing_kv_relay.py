"""A TCP relay in front of an engine's KV receiver that forwards every KV stage frame with its payload
replaced by zeros (headers and acks unchanged), for the negative control of the migration tests: a
request resumed on zeros must diverge from its reference, so an exact migration proves the staged KV
is what the destination used. Framing: llumnix/engine/kv_transport.py (TCP transport only)."""

from __future__ import annotations

import contextlib
import socket
import threading

from llumnix.engine.kv_transport import encode_message, parse_tcp_address, read_frame


class ZeroingKVRelay:
    def __init__(self, upstream: str) -> None:
        self._upstream = parse_tcp_address(upstream)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.frames = 0
        """Frames relayed (zeroed) so far: a test checks the stages went through the relay."""
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="zeroing-relay", daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                source, _ = self._listener.accept()
                destination = socket.create_connection(self._upstream)
                with self._lock:
                    self._sockets += [source, destination]
                threading.Thread(target=self._frames, args=(source, destination), daemon=True).start()
                threading.Thread(target=self._acks, args=(destination, source), daemon=True).start()

    def _frames(self, source: socket.socket, destination: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the source hung up (or the relay closed)
            while True:
                header = read_frame(source).header
                with self._lock:  # counted before it is sent: before the source can see its ack
                    self.frames += 1
                destination.sendall(encode_message(header) + bytes(header.payload_bytes))
        with contextlib.suppress(OSError):
            destination.shutdown(socket.SHUT_WR)

    @staticmethod
    def _acks(destination: socket.socket, source: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := destination.recv(1 << 16):
                source.sendall(data)
            source.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
