"""How soon a caller reaches a llumlet that came back at the same address: a gRPC server is stopped for
`--outage` seconds while a client calls it every second (as a load stream retries), then restarted;
the script prints how long after the restart a waiting call is answered, on the same channel and on a
new one, with gRPC's default reconnect backoff and with the llumlet channel's
(`llumnix.llumlet_client.CHANNEL_OPTIONS`).

    .venv/bin/python bench/grpc_reconnect.py               # 30 s outage
    .venv/bin/python bench/grpc_reconnect.py --outage 120

gRPC's backoff (1 s, growing 1.6x to 120 s, with jitter) is kept per address, not per channel, so a
new channel waits it out too; the figures vary by the jitter, not by the machine's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence

import grpc

from llumnix.launch.pair import free_port
from llumnix.llumlet_client import CHANNEL_OPTIONS

METHOD = "/llumnix.bench.Reconnect/Ping"
ChannelOptions = Sequence[tuple[str, int]]


async def _serve(port: int) -> grpc.aio.Server:
    async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(ping)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("llumnix.bench.Reconnect",
                                                                          {"Ping": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def seconds_to_reach(options: ChannelOptions, new_channel: bool, outage_s: float) -> float:
    """Seconds from the server's restart until a call waiting for it is answered."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = await _serve(port)
    channel = grpc.aio.insecure_channel(address, options=list(options))
    await channel.unary_unary(METHOD)(b"up", timeout=10)
    await server.stop(0)
    down_until = time.monotonic() + outage_s
    while time.monotonic() < down_until:  # the caller keeps trying, as a load stream does
        with contextlib.suppress(grpc.aio.AioRpcError):
            await channel.unary_unary(METHOD)(b"x", timeout=1)
        await asyncio.sleep(1)
    server = await _serve(port)
    restarted = time.monotonic()
    if new_channel:
        await channel.close()
        channel = grpc.aio.insecure_channel(address, options=list(options))
    await channel.unary_unary(METHOD)(b"x", wait_for_ready=True, timeout=300)
    answered = time.monotonic() - restarted
    await channel.close()
    await server.stop(0)
    return answered


async def main(outage_s: float) -> None:
    print(f"a server down {outage_s:g} s, called every second meanwhile; restarted:")
    for name, options in (("gRPC defaults", ()), ("llumlet channel", CHANNEL_OPTIONS)):
        for new_channel in (False, True):
            seconds = await seconds_to_reach(options, new_channel, outage_s)
            which = "a new channel" if new_channel else "the same channel"
            print(f"  {name:16} {which:17} answered {seconds:5.1f} s after the restart", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage", type=float, default=30.0, metavar="SECONDS",
                        help="how long the server is down (default: %(default)s)")
    asyncio.run(main(parser.parse_args().outage))
