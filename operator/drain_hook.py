"""`llumnix drain-instance`: the engine pod's preStop hook. Marks the local llumlet as draining (the
router stops sending it requests and the control loop migrates its requests away), then waits until no
request is left on it, so that deleting a pod never cuts a request off.

    llumnix drain-instance --address 127.0.0.1:50051 --timeout 150
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from tqdm import tqdm

from llumnix.service_token import CallMetadata, ServiceToken, call_metadata
from llumnix.v1 import llumlet_pb2, llumlet_pb2_grpc
from llumnix_operator.naming import LLUMLET_GRPC_PORT

RPC_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=f"127.0.0.1:{LLUMLET_GRPC_PORT}",
        help="the llumlet's gRPC address (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=150.0,
        metavar="SECONDS",
        help="give up waiting after this long (default: %(default)s)",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="how often the remaining requests are counted (default: %(default)s)",
    )


def drain(stub: llumlet_pb2_grpc.LlumletStub, timeout_s: float, poll_interval_s: float,
          metadata: CallMetadata = ()) -> int:
    """Requests still on the instance when the wait ended (0: drained). `metadata`: the service token
    the llumlet requires (the hook runs in the pod's containers, which hold it in their environment)."""
    deadline = time.monotonic() + timeout_s
    in_flight = stub.SetDraining(
        llumlet_pb2.SetDrainingRequest(draining=True), timeout=RPC_TIMEOUT_S, metadata=metadata
    ).in_flight
    with tqdm(total=in_flight, desc="draining", unit="req", disable=None) as bar:
        while in_flight and time.monotonic() < deadline:
            time.sleep(poll_interval_s)
            remaining = stub.Health(
                llumlet_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S, metadata=metadata
            ).in_flight
            bar.update(max(0, in_flight - remaining))
            in_flight = remaining
    return in_flight


def run(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address) as channel:
        try:
            left = drain(llumlet_pb2_grpc.LlumletStub(channel), args.timeout, args.poll_interval,
                         call_metadata(ServiceToken.from_environment()))
        except grpc.RpcError as exc:
            # A llumlet that is already gone holds no requests: nothing to drain.
            print(
                f"llumnix drain-instance: llumlet at {args.address} unreachable ({exc.code().name}); "
                "nothing to drain",
                file=sys.stderr,
            )
            return 0
    if left:
        print(
            f"llumnix drain-instance: {left} request(s) still running after {args.timeout:.0f} s",
            file=sys.stderr,
        )
        return 1
    print("llumnix drain-instance: drained", file=sys.stderr)
    return 0
