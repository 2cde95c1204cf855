"""Inspect and steer a running service through its admin API (`llumnix up` serves it):

    llumnix admin status
    llumnix admin drain svc-1
    llumnix admin undrain svc-1
    llumnix admin migrate --source svc-0 --destination svc-1 [--request-id ID]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any

import aiohttp

from llumnix.control.status import FREENESS_MEANING, headroom

DEFAULT_ADMIN_URL = "http://127.0.0.1:8090"


def _common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    parser.add_argument("--url", default=argparse.SUPPRESS if suppress else DEFAULT_ADMIN_URL,
                        help=f"admin API base URL (default: {DEFAULT_ADMIN_URL})")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS if suppress else False,
                        help="print the API's JSON answer as is")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common_options(parser, suppress=False)
    # The same options after the action (`llumnix admin status --url ...`); SUPPRESS keeps a value
    # given before it.
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, suppress=True)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("status", help="instances, loads and counters", parents=[common])
    for action, help_text in (("drain", "migrate an instance's requests out, then release it"),
                              ("undrain", "cancel a drain")):
        sp = sub.add_parser(action, help=help_text, parents=[common])
        sp.add_argument("instance_id")
    migrate = sub.add_parser("migrate", help="move one running request to another instance now",
                             parents=[common])
    migrate.add_argument("--source", required=True, help="instance the request runs on")
    migrate.add_argument("--destination", required=True, help="instance to move it to")
    migrate.add_argument("--request-id", help="the request (default: the source llumlet's choice)")


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if math.isfinite(value) else "inf"


def format_status(status: dict[str, Any]) -> str:
    """The status JSON as a table plus a line of counters; freeness with what it means."""
    block_size = status.get("block_size")
    aggregate = headroom(status["aggregate_freeness"], block_size, idle=status["idle"])
    header = (f"{'INSTANCE':<20}{'PHASE':<12}{'FREENESS':>10}  {'HEADROOM':<20}{'RUNNING':>7}{'WAITING':>9}  "
              f"{'DRAINING':<9}ADDRESS")
    lines = [f"service {status['name']}: {status['ready']} ready / {status['desired']} desired, "
             f"aggregate freeness {_fmt(status['aggregate_freeness'])} ({aggregate})", header]
    for i in status["instances"]:
        room = headroom(i["freeness"], i.get("block_size"), idle=i["idle"], draining=i["draining"])
        lines.append(f"{i['instance_id']:<20}{i['phase']:<12}{_fmt(i['freeness']):>10}  {room:<20}"
                     f"{i['running']:>7}{i['waiting']:>9}  {'yes' if i['draining'] else 'no':<9}"
                     f"{i['address'] or '-'}" + (f"  ({i['message']})" if i['message'] else ""))
    migrations = ", ".join(f"{k} {v}" for k, v in sorted(status["migrations"].items())) or "none"
    lines.append(f"migrations: {migrations}; scale-ups {status['scale_ups']}, drains {status['drains']}, "
                 f"releases {status['releases']}, replacements {status['replacements']}")
    decision = status.get("last_decision")
    if decision:
        lines.append(f"last decision: {decision['kind']} {decision.get('instance_id') or ''} "
                     f"({decision['reason']}; aggregate freeness "
                     f"{_fmt(decision.get('aggregate_freeness'))})")
    lines.append(FREENESS_MEANING)
    return "\n".join(lines)


async def _call(args: argparse.Namespace) -> tuple[int, Any]:
    base = args.url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        if args.action == "status":
            call = session.get(base + "/instances")
        elif args.action in ("drain", "undrain"):
            call = session.post(f"{base}/instances/{args.instance_id}/{args.action}")
        else:
            body = {"source": args.source, "destination": args.destination}
            if args.request_id:
                body["request_id"] = args.request_id
            call = session.post(base + "/migrate", json=body)
        async with call as response:
            return response.status, await response.json(content_type=None)


def _downtime_parts(parts: dict[str, float]) -> str:
    """Where a committed migration's downtime went (docs/migration.md, "Where the downtime goes")."""
    return (f"final stage {parts['final_stage']:.1f} ms, Commit {parts['commit']:.1f} ms of which "
            f"{parts['destination_first_token']:.1f} ms to the destination's first token")


def run(args: argparse.Namespace) -> int:
    try:
        status, payload = asyncio.run(_call(args))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"llumnix admin: cannot reach the admin API at {args.url}: {exc or type(exc).__name__}",
              file=sys.stderr)
        return 1
    except json.JSONDecodeError:
        print(f"llumnix admin: {args.url} did not answer JSON; is it a llumnix admin API?", file=sys.stderr)
        return 1
    if status != 200:
        message = payload.get("error") if isinstance(payload, dict) else payload
        print(f"llumnix admin: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(payload, indent=2))
    elif args.action == "status":
        print(format_status(payload))
    elif args.action == "migrate":
        print(f"migration {payload['outcome']}: request {payload['request_id'] or '-'}"
              + (f", {payload['migrated_tokens']} tokens moved, downtime {payload['downtime_ms']:.1f} ms"
                 f" ({_downtime_parts(payload['downtime_parts_ms'])})"
                 if payload["outcome"] == "committed" else f" ({payload['reason']})"))
    else:
        print(f"{payload['instance_id']}: draining {'on' if payload['draining'] else 'off'}")
    return 0
