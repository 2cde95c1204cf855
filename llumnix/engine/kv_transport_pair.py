"""Pair channels: the KV transport for "gloo" and "nccl", one implementation parameterised by the
backend. Each migration gets a two-rank channel whose rendezvous the destination engine opened
(`ChannelRendezvous`, answering the llumlet's OpenChannel command) and its llumlet returned in Propose's
answer; the source engine receives it in its export commands. The destination's receiver is rank 0,
the source engine's sender rank 1.

Control goes over TCP, in the frames of llumnix/engine/kv_transport.py, to the destination's `kv_address`:
1. the sender's first header carries the `KVChannel` and the migration's key (no payload); the
   receiver checks the key, acks it and both join the pair (`join_pair`: gloo through the
   destination's TCP store, nccl with its unique id);
2. per stage: the header goes over TCP; the receiver checks the layout and answers a go-ahead ack (or a
   refusal: then nothing is sent on the pair, which stays in step); the payload goes over the pair into
   a buffer on the receiver's device, which lands in the `StagingStore`; a final ack closes the stage.
The pair lives as long as its TCP connection: the sender closes it after the migration's final stage.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from typing import Any, Protocol

from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport import (
    KV_FRAME_SCHEMA_VERSION,
    KVSender,
    KVTransportError,
    StageCallback,
    encode_message,
    parse_tcp_address,
    read_ack,
    recv_into_exact,
    recv_message,
)
from llumnix.engine.kv_transport_tcp import TcpKVReceiver
from llumnix.v1.kv_transfer_pb2 import KVChannel, KVStageAck, KVStageHeader, OpenChannel

log = logging.getLogger("vllm.llumnix")

PAIR_BACKENDS = ("gloo", "nccl")
RECEIVER_RANK, SENDER_RANK = 0, 1


def is_cuda(device: Any) -> bool:
    """Whether `device` (a torch.device, a name such as "cuda:1", or None) is a CUDA device."""
    return device is not None and str(getattr(device, "type", device)).startswith("cuda")


class PairCommunicator(Protocol):
    """Two ranks, point to point, flat uint8 tensors on the pair's device."""

    def send(self, flat: Any) -> None: ...

    def recv(self, size: int) -> Any: ...

    def close(self) -> None: ...


def join_pair(channel: KVChannel, rank: int, local_host: str, timeout_s: float,
              device: Any = None) -> PairCommunicator:
    """Joins `channel` as `rank`; blocks until the peer joined too. `local_host`: this end's address on
    the route to the peer (gloo binds its device there); `device`: the engine's KV cache device (nccl
    payloads arrive there; gloo's arrive in host memory, page-locked for a CUDA cache)."""
    if channel.backend == "gloo":
        from llumnix.engine.kv_transport_gloo import GlooPair

        return GlooPair(channel, rank, local_host, timeout_s, pin_memory=is_cuda(device))
    if channel.backend == "nccl":
        from llumnix.engine.kv_transport_nccl import NcclPair

        return NcclPair(channel, rank, device)
    raise KVTransportError(f"unknown pair channel backend {channel.backend!r}; expected one of "
                           f"{PAIR_BACKENDS}")


class ChannelRendezvous:
    """The destination engine's side of OpenChannel: a fresh channel per migration. A gloo channel's
    TCP store (on `host`, reachable by the source engine) is kept for `lease_s`, the staging lease:
    the pair needs it only to connect, on the migration's first stage."""

    def __init__(self, host: str, lease_s: float, timeout_s: float) -> None:
        self._host = host
        self._lease_s = lease_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stores: dict[str, tuple[Any, float]] = {}  # channel id -> (store, when it may go)

    def open(self, command: OpenChannel) -> KVChannel:
        channel_id = f"{command.migration_id}-{uuid.uuid4().hex[:8]}"
        channel = KVChannel(backend=command.backend, channel_id=channel_id)
        if command.backend == "nccl":
            from llumnix.engine.kv_transport_nccl import new_nccl_unique_id

            channel.nccl_unique_id = new_nccl_unique_id()
        elif command.backend == "gloo":
            from llumnix.engine.kv_transport_gloo import open_store

            store, channel.store_address = open_store(self._host, self._timeout_s)
            now = time.monotonic()
            with self._lock:
                for key in [k for k, (_, until) in self._stores.items() if until <= now]:
                    del self._stores[key]
                self._stores[channel.channel_id] = (store, now + self._lease_s)
        else:
            raise ValueError(f"unknown pair channel backend {command.backend!r}; expected one of "
                             f"{PAIR_BACKENDS}")
        return channel

    def close(self) -> None:
        with self._lock:
            self._stores.clear()


class PairKVSender(KVSender):
    """Source side of one pair channel. The payload is a flat uint8 tensor on the pair's device (CPU for
    gloo, the engine's GPU for nccl); the pair is joined on the first send. A broken pair is not
    rejoined (its rendezvous served once): the stage fails and the migration aborts."""

    def __init__(self, address: str, channel: KVChannel, timeout_s: float = 10.0) -> None:
        if channel.backend == "nccl":
            from llumnix.engine.kv_transport_nccl import require_cuda

            require_cuda()
        self.address = address
        self.channel = channel
        self.timeout_s = timeout_s
        self._endpoint = parse_tcp_address(address)
        self._sock: socket.socket | None = None
        self._pair: PairCommunicator | None = None
        self._broken = ""
        self._lock = threading.Lock()

    def _join(self, device: Any, first: KVStageHeader) -> tuple[socket.socket, PairCommunicator]:
        """`first`: the first stage's header, whose migration and key the hello carries."""
        try:
            sock = socket.create_connection(self._endpoint, timeout=self.timeout_s)
        except OSError as exc:
            raise KVTransportError(f"cannot connect to KV receiver {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = KVStageHeader(schema_version=KV_FRAME_SCHEMA_VERSION, channel=self.channel,
                              migration_id=first.migration_id, kv_key=first.kv_key)
        try:
            sock.sendall(encode_message(hello))
            ack = read_ack(sock)
            if not ack.ok:
                raise KVTransportError(f"{self.address} refused {self.channel.backend} channel: {ack.error}")
            # Collective with the receiver's own join, which it starts after its ack.
            return sock, join_pair(self.channel, SENDER_RANK, sock.getsockname()[0], self.timeout_s, device)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, KVTransportError):
                raise
            raise KVTransportError(f"{self.channel.backend} channel to {self.address} failed: {exc}") from exc

    def _drop(self, why: str) -> None:
        self._broken = why
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._pair is not None:
            self._pair.close()
        self._sock, self._pair = None, None

    def send(self, header: KVStageHeader, payload: Any) -> KVStageAck:
        flat = payload.reshape(-1)
        if header.payload_bytes != flat.numel():
            raise ValueError(f"header says {header.payload_bytes} bytes, the payload has {flat.numel()}")
        with self._lock:
            if self._broken:
                raise KVTransportError(f"{self.channel.backend} channel {self.channel.channel_id} is closed: "
                                       f"{self._broken}")
            if self._sock is None or self._pair is None:
                try:
                    self._sock, self._pair = self._join(flat.device, header)
                except KVTransportError as exc:
                    self._broken = str(exc)
                    raise
            try:
                self._sock.sendall(encode_message(header))
                go = read_ack(self._sock)
                if go.ok:
                    if header.payload_bytes:
                        self._pair.send(flat)
                    ack = read_ack(self._sock)
            except Exception as exc:  # socket errors and the backend's own (gloo raises RuntimeError)
                self._drop(str(exc))
                raise KVTransportError(
                    f"stage {header.stage} of {header.migration_id} to {self.address} failed: {exc}"
                ) from exc
            if not go.ok:  # refused before anything went over the pair: it stays usable
                raise KVTransportError(f"{self.address} refused stage {header.stage}: {go.error}")
            if not ack.ok:
                raise KVTransportError(f"{self.address} could not stage {header.stage}: {ack.error}")
            return ack

    def close(self) -> None:
        with self._lock:
            self._drop("closed")


class KVStageReceiver(TcpKVReceiver):
    """The engine's KV receiver: TCP frames, and pair channels whose first header names the channel.
    `device`: the engine's KV cache device (nccl payloads arrive there; tcp's and gloo's in host memory,
    page-locked when the cache is on CUDA: its load then copies at the bus's speed, 51.6 GiB/s against
    8.9 from pageable memory on an H200 host, and the load at admission is part of the downtime)."""

    def __init__(self, host: str, port: int = 0, *, staging: StagingStore,
                 on_stage: StageCallback | None = None, device: Any = None,
                 timeout_s: float = 10.0, kv_secret: str | None = None) -> None:
        super().__init__(host, port, staging=staging, on_stage=on_stage, kv_secret=kv_secret)
        self.device = device
        self.timeout_s = timeout_s

    def _receive_payload(self, conn: socket.socket, size: int) -> Any:
        if not is_cuda(self.device):
            return super()._receive_payload(conn, size)
        import torch  # a CUDA cache: torch is loaded

        flat = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        recv_into_exact(conn, memoryview(flat.numpy()))
        return flat

    def _serve_connection(self, conn: socket.socket, header: KVStageHeader) -> None:
        if not header.HasField("channel"):
            super()._serve_connection(conn, header)
            return
        if not self.admits(header):  # before joining: an unnegotiated peer gets no pair
            self.refuse(conn, header)
            return
        try:
            if header.channel.backend == "nccl":
                from llumnix.engine.kv_transport_nccl import require_cuda

                require_cuda(self.device)
            elif header.channel.backend != "gloo":
                raise KVTransportError(f"unknown pair channel backend {header.channel.backend!r}")
        except KVTransportError as exc:
            conn.sendall(encode_message(self._ack(header, str(exc))))
            return
        conn.sendall(encode_message(self._ack(header)))
        channel = header.channel
        try:
            pair = join_pair(channel, RECEIVER_RANK, conn.getsockname()[0], self.timeout_s, self.device)
        except RuntimeError as exc:  # the backend's own errors (a peer that never joined: a timeout)
            log.warning("llumnix KV %s channel %s: joining failed: %s", channel.backend,
                        channel.channel_id, exc)
            return
        try:
            self._serve_pair(conn, pair)
        except RuntimeError as exc:  # the backend's own errors (the peer died mid-payload)
            log.warning("llumnix KV %s channel %s failed: %s", channel.backend, channel.channel_id, exc)
        finally:
            pair.close()

    def _serve_pair(self, conn: socket.socket, pair: PairCommunicator) -> None:
        while not self._stop.is_set():
            header = KVStageHeader.FromString(recv_message(conn))
            if not self.admits(header):
                self.refuse(conn, header)
                return
            try:
                self.staging.check_layout(header)
            except ValueError as exc:
                conn.sendall(encode_message(self._ack(header, str(exc))))
                continue  # nothing was sent on the pair: it stays in step
            conn.sendall(encode_message(self._ack(header)))
            self._store(header, pair.recv(header.payload_bytes))  # zero bytes: an empty tensor
            conn.sendall(encode_message(self._ack(header)))
