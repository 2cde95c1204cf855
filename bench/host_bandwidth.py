"""What a host moves per second for the KV data plane, beside bench/kv_channel_gpu.py: host-to-device
from pageable and from page-locked memory, device-to-host into a fresh tensor, a memcpy into a fresh
and into a reused bytearray (first touches of a VM's memory), and Python loopback TCP into a buffer
(1 GiB each; CUDA rows need a GPU).

    python bench/host_bandwidth.py
"""

from __future__ import annotations

import socket
import threading
import time

import torch

GIB = 1 << 30


def _rate(action) -> float:
    started = time.perf_counter()
    action()
    return 1 / (time.perf_counter() - started)


def loopback_tcp(data: bytearray, target: bytearray) -> float:
    """GiB/s of one connection sending `data` into `target` over 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(target), 0
        while got < len(target):
            got += conn.recv_into(view[got:], len(target) - got, socket.MSG_WAITALL)
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname()[:2])
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send() -> None:
        client.sendall(memoryview(data))
        client.recv(1)

    rate = _rate(send)
    thread.join()
    client.close()
    server.close()
    return rate


def main() -> None:
    host = torch.ones(GIB, dtype=torch.uint8)
    fresh = bytearray(GIB)
    first = _rate(lambda: memoryview(fresh).__setitem__(slice(None), memoryview(host.numpy())))
    again = _rate(lambda: memoryview(fresh).__setitem__(slice(None), memoryview(host.numpy())))
    print(f"memcpy into a fresh bytearray {first:.1f} GiB/s, into the same again {again:.1f} GiB/s")
    print(f"loopback TCP into a buffer: {loopback_tcp(bytearray(host.numpy()), fresh):.2f} GiB/s")
    if torch.cuda.is_available():
        device = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        pinned = host.pin_memory()

        def to_device(source: torch.Tensor) -> float:
            device.copy_(source)  # warm-up
            torch.cuda.synchronize()
            return _rate(lambda: (device.copy_(source), torch.cuda.synchronize()))

        print(f"host-to-device from pageable {to_device(host):.1f} GiB/s, from page-locked "
              f"{to_device(pinned):.1f} GiB/s; device-to-host into a fresh tensor "
              f"{_rate(device.cpu):.1f} GiB/s")


if __name__ == "__main__":
    main()
