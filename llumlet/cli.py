"""Run the llumlet sidecar next to one engine: it fronts the engine's OpenAI API, computes the
instance's live load from the engine's snapshots and serves the llumlet gRPC API."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import uvloop

from llumlet.migration.settings import TRANSPORTS, MigrationSettings
from llumlet.server import Llumlet, LlumletConfig
from llumnix.engine.snapshots import SNAPSHOT_ADDR_ENV
from llumnix.jsonlog import configure_json_logging
from llumnix.load import DEFAULT_HIGH_PRIORITY_TARGET_TOKENS
from llumnix.policies.migration import SELECT_POLICIES
from llumnix.service_token import SERVICE_TOKEN_ENV, ServiceToken

logger = logging.getLogger("llumlet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance-id", default=os.environ.get("LLUMNIX_INSTANCE_ID", socket.gethostname()),
                        help="name of this instance in loads and logs (default: $LLUMNIX_INSTANCE_ID "
                             "or the host name)")
    parser.add_argument("--engine-url", default="http://127.0.0.1:8000",
                        help="the engine's OpenAI HTTP server (default: %(default)s)")
    parser.add_argument("--snapshot-addr", default=os.environ.get(SNAPSHOT_ADDR_ENV),
                        help=f"ZeroMQ address the engine's connector publishes snapshots on "
                             f"(default: ${SNAPSHOT_ADDR_ENV})")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=8100,
                        help="OpenAI API, /health and /metrics (default: %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=50051,
                        help="llumlet gRPC API (default: %(default)s)")
    parser.add_argument("--snapshot-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="fall back to the engine's /metrics when no snapshot arrives for this long "
                             "while the engine has work (default: %(default)s)")
    parser.add_argument("--engine-check-interval", type=float, default=0.5, metavar="SECONDS",
                        help="how often the engine's /health and /metrics are polled (default: %(default)s)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may run on (default: %(default)s)")
    parser.add_argument("--engine-priority-scheduling", action="store_true",
                        help="the engine runs with --scheduling-policy priority: pass high priority on")
    parser.add_argument("--high-priority-target-tokens", type=int,
                        default=DEFAULT_HIGH_PRIORITY_TARGET_TOKENS,
                        help="tokens an instance with high-priority requests is kept near "
                             "(default: %(default)s)")
    defaults = MigrationSettings()
    parser.add_argument("--max-concurrent-migrations", type=int, default=defaults.max_concurrent,
                        help="migrations this instance takes part in at once, in and out "
                             "(default: %(default)s)")
    parser.add_argument("--migration-select", choices=SELECT_POLICIES, default=defaults.select,
                        help="request MigrateOut moves when not told (default: %(default)s)")
    parser.add_argument("--migration-freeness-threshold", type=float, default=defaults.freeness_threshold,
                        help="as a destination, take a request only if freeness stays at or above this "
                             "(default: %(default)s)")
    parser.add_argument("--migration-max-stages", type=int, default=defaults.max_stages,
                        help="KV stages before the final one at most; 0 copies everything in the final "
                             "stage (default: %(default)s)")
    parser.add_argument("--migration-final-delta-blocks", type=int, default=defaults.final_delta_blocks,
                        help="start the final stage once at most this many blocks are left to send "
                             "(default: %(default)s)")
    parser.add_argument("--migration-lease", type=float, default=defaults.lease_s, metavar="SECONDS",
                        help="a destination's reservation and staging live this long unless renewed "
                             "(default: %(default)s)")
    parser.add_argument("--migration-commit-timeout", type=float, default=defaults.commit_timeout_s,
                        metavar="SECONDS", help="how long the source waits for the destination's first token "
                        "before it resumes the request itself (default: %(default)s)")
    parser.add_argument("--migration-peer-timeout", type=float, default=defaults.peer_timeout_s,
                        metavar="SECONDS", help="how long the source waits for the destination's answer to "
                        "Propose, Renew and Abort (default: %(default)s)")
    parser.add_argument("--migration-transport", choices=TRANSPORTS, default=defaults.transport,
                        help="KV channel of migrations: tcp or nccl refuses a migration over the other, "
                             "auto takes the destination engine's (default: %(default)s)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help=f"serve without a service token when ${SERVICE_TOKEN_ENV} is unset (development "
                             "only: anyone who reaches the ports can then generate, drain and migrate)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    if not args.snapshot_addr:
        print(f"llumlet: --snapshot-addr or ${SNAPSHOT_ADDR_ENV} is required", file=sys.stderr, flush=True)
        return 2
    # The token comes from the environment (a Secret in a pod, local mode's own): never argv, which `ps`
    # shows to every user of the machine.
    token = ServiceToken.from_environment()
    if token is None and not args.allow_unauthenticated:
        print(f"llumlet: ${SERVICE_TOKEN_ENV} is required (the service token every caller must present); "
              "--allow-unauthenticated serves without one, for development", file=sys.stderr, flush=True)
        return 2
    configure_json_logging(args.instance_id, args.log_level)
    if token is None:
        logger.warning("NO SERVICE TOKEN: anyone who reaches this llumlet's ports can generate, drain and "
                       "migrate (--allow-unauthenticated)")
    try:
        migration = MigrationSettings(
            max_concurrent=args.max_concurrent_migrations, select=args.migration_select,
            freeness_threshold=args.migration_freeness_threshold, max_stages=args.migration_max_stages,
            final_delta_blocks=args.migration_final_delta_blocks, lease_s=args.migration_lease,
            commit_timeout_s=args.migration_commit_timeout, peer_timeout_s=args.migration_peer_timeout,
            transport=args.migration_transport)
    except ValueError as exc:
        print(f"llumlet: {exc}", file=sys.stderr, flush=True)
        return 2
    config = LlumletConfig(
        instance_id=args.instance_id,
        engine_url=args.engine_url,
        snapshot_addr=args.snapshot_addr,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        snapshot_timeout_s=args.snapshot_timeout,
        engine_check_interval_s=args.engine_check_interval,
        shutdown_grace_s=args.shutdown_grace,
        engine_priority_scheduling=args.engine_priority_scheduling,
        high_priority_target_tokens=args.high_priority_target_tokens,
        migration=migration,
        service_token=token,
    )
    try:
        uvloop.run(Llumlet(config).serve_until_signal())
    except (OSError, ValueError) as exc:
        print(f"llumlet: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
