"""Run a simulated engine: vLLM's OpenAI HTTP API and the KV connector's load snapshots, with
iteration times from a latency profile and a KV block pool of configurable size. No model, no GPU:
tens of them fit on one machine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from llumnix.engine.snapshots import SNAPSHOT_ADDR_ENV
from llumnix.profile import DEFAULT_PROFILE, bundled_profiles
from llumnix.sim.instance import DEFAULT_WATERMARK
from llumnix.sim_engine.migration import DEFAULT_KV_BYTES_PER_BLOCK
from llumnix.sim_engine.server import SimEngineConfig, SimEngineServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--kv-host", help="address the KV receiver of live migration listens on, where peer "
                        "engines reach it (default: --host)")
    parser.add_argument(
        "--model",
        default="sim",
        metavar="NAME",
        help="served model name, as in /v1/models and the 'model' field (default: %(default)s)",
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="NAME_OR_PATH",
        help=f"latency profile: one of {', '.join(bundled_profiles())} or a profile JSON file "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--num-blocks", type=int, metavar="N", help="KV-cache blocks (default: the profile's KV capacity)"
    )
    parser.add_argument(
        "--block-size", type=int, metavar="TOKENS", help="tokens per KV block (default: the profile's)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, metavar="N", help="most requests in one batch (default: the profile's)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        metavar="TOKENS",
        help="longest prompt + output (default: 4096, or what the block pool holds)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="run X times faster than the profile's real time (default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot-addr",
        default=os.environ.get(SNAPSHOT_ADDR_ENV),
        metavar="ADDR",
        help=f"ZeroMQ address to publish load snapshots on, e.g. ipc:///tmp/engine-0.sock "
        f"(default: ${SNAPSHOT_ADDR_ENV}; none: no snapshots)",
    )
    parser.add_argument(
        "--engine-id",
        metavar="ID",
        help="engine id in snapshots; make it unique per process start (default: sim-<host>-<pid>)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the next-token function; engines that resume each other's requests "
        "must share it (default: %(default)s)",
    )
    parser.add_argument(
        "--eos-probability",
        type=float,
        default=0.0,
        metavar="P",
        help="chance per generated token of ending the sequence, unless the request sets "
        "ignore_eos (default: %(default)s: every request runs to max_tokens)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="as vLLM's: with 'priority', requests with priority < 0 are served first and "
        "preempted last (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-bytes-per-block",
        type=int,
        default=DEFAULT_KV_BYTES_PER_BLOCK,
        metavar="BYTES",
        help="size of the fake KV payload per block that live migrations send (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="as vLLM's automatic prefix caching: full blocks are kept by content and shared, a prompt "
        "whose leading blocks are cached skips their prefill, and the snapshots report the cached blocks "
        "(default: off)",
    )
    parser.add_argument(
        "--watermark",
        type=float,
        default=DEFAULT_WATERMARK,
        metavar="F",
        help="as vLLM's: the share of the blocks kept free when admitting a prompt (default: %(default)s, "
        "vLLM v0's; vLLM 0.32 keeps none unless told)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = SimEngineConfig(
        model=args.model,
        profile=args.profile,
        host=args.host,
        port=args.port,
        kv_host=args.kv_host,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        snapshot_addr=args.snapshot_addr,
        engine_id=args.engine_id or f"sim-{socket.gethostname()}-{os.getpid()}",
        seed=args.seed,
        eos_probability=args.eos_probability,
        priority_scheduling=args.scheduling_policy == "priority",
        kv_bytes_per_block=args.kv_bytes_per_block,
        prefix_caching=args.enable_prefix_caching,
        watermark=args.watermark,
    )
    try:
        server = SimEngineServer(config)
        asyncio.run(server.serve_until_signal())
    except ValueError as exc:
        print(f"sim-engine: {exc}", flush=True)
        return 2
    except OSError as exc:
        print(
            f"sim-engine: cannot listen on {args.host}:{args.port} or bind {args.snapshot_addr}: {exc}",
            flush=True,
        )
        return 1
    return 0
