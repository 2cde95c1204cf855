"""Run the router: an OpenAI-compatible endpoint that dispatches every request to one of a service's
llumlets by their live load, follows migrations and resumes requests whose instance failed.

    llumnix router --model tiny --instances 10.0.0.5:50051,10.0.0.6:50051
    llumnix router --service service.yaml --instances-file instances.txt
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import socket
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import uvloop

from llumnix.jsonlog import configure_json_logging
from llumnix.load import DEFAULT_HIGH_PRIORITY_TARGET_TOKENS, LoadModelConfig
from llumnix.policies.dispatch import DEFAULT_BUSY_FREENESS, DEFAULT_PREFIX_WEIGHT, POLICY_NAMES
from llumnix.router import workers
from llumnix.router.api import ApiSettings
from llumnix.router.api_keys import API_KEYS_ENV, load_api_keys
from llumnix.router.client_request import PrioritySettings, RequestLimits
from llumnix.router.generation import GenerationLimits
from llumnix.router.instance_source import (
    DnsInstanceSource,
    FileInstanceSource,
    InstanceSource,
    ListInstanceSource,
    parse_addresses,
)
from llumnix.router.server import Router, RouterConfig
from llumnix.service_spec import DispatchSpec, PrioritiesSpec, SpecError, load_service_file
from llumnix.service_token import SERVICE_TOKEN_ENV, ServiceToken

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", metavar="FILE",
                        help="take the model name, port, dispatch policy and priority settings from an "
                        "LLMService manifest (flags given explicitly win)")
    parser.add_argument("--model", help="served model name (/v1/models); required without --service")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--instances", metavar="ADDRS", default="",
                       help="llumlet gRPC addresses host:port, comma-separated")
    where.add_argument("--instances-file", metavar="FILE", type=Path,
                       help="file of llumlet gRPC addresses (one per line), re-read when it changes")
    where.add_argument("--instances-dns", metavar="NAME:PORT",
                       help="DNS name whose addresses are the llumlets (a Kubernetes headless Service), "
                       "re-resolved every 2 s")
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: %(default)s)")
    parser.add_argument("--port", type=int, help="HTTP port (default: the service's, or 8000)")
    parser.add_argument("--dispatch-policy", choices=POLICY_NAMES, help="default: the service's, or llumnix")
    parser.add_argument("--busy-freeness", type=float,
                        help=f"below this freeness an instance is busy (default {DEFAULT_BUSY_FREENESS})")
    parser.add_argument("--top-k", type=int, help="random choice among the k best instances (default 1)")
    parser.add_argument("--prefix-weight", type=float,
                        help="llumnix policy: preference for an instance holding a token-id prompt's prefix "
                        f"in its cache, 0: ignore caches (default {DEFAULT_PREFIX_WEIGHT})")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="the model's tokenizer (a local folder), so that text and chat prompts are "
                        "looked up in the instances' prefix caches too (default: token-id prompts only)")
    parser.add_argument("--high-priority-target-tokens", type=int,
                        help=f"load model: load kept on instances with high-priority requests "
                        f"(default {DEFAULT_HIGH_PRIORITY_TARGET_TOKENS})")
    parser.add_argument("--priority-header", help="header whose value `high` marks high priority "
                        "(default: x-llumnix-priority)")
    parser.add_argument("--priority-field", default="priority",
                        help="body field (`high`/`normal`/`low`) marking priority; removed before "
                        "forwarding (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=1024,
                        help="requests held while every instance is busy; beyond: 503 (default: %(default)s)")
    parser.add_argument("--queue-timeout", type=float, default=60.0, metavar="S",
                        help="longest wait in that queue before a 503 (default: %(default)s)")
    parser.add_argument("--max-attempts", type=int, default=4,
                        help="instances one request may be sent to: the first, then one per retry or "
                        "replay; following a live migration is not an attempt (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=8 << 20, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int,
                        help="largest max_tokens a client may ask for (default: any)")
    parser.add_argument("--max-prompt-tokens", type=int,
                        help="longest prompt (default: the engine's context)")
    parser.add_argument("--max-model-len", type=int,
                        help="the engines' context length: reported in /v1/models and needed to resume "
                        "chat requests without max_tokens")
    parser.add_argument("--api-keys-file", type=Path,
                        help=f"file of accepted API keys, one per line (also ${API_KEYS_ENV}, "
                        "comma-separated); none: no authentication of clients. The llumlets' own "
                        f"credential, which the router presents to them, is ${SERVICE_TOKEN_ENV}")
    parser.add_argument("--workers", type=int, default=1,
                        help="router processes sharing the port, each dispatching from the load streams "
                        "plus its own in-flight requests; more than one helps only with cores to spare "
                        "(default: %(default)s)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, how long in-flight requests may run on (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _first(given: T | None, default: T) -> T:
    return default if given is None else given


def build_config(args: argparse.Namespace) -> RouterConfig:
    """The flags given, else the manifest's values (--service), else the router's defaults."""
    spec = load_service_file(args.service).spec if args.service else None
    model = args.model or (spec.model.name if spec else None)
    if not model:
        raise ValueError("give --model (the served model name) or --service")
    if spec is not None:
        dispatch, priorities, port = spec.dispatch, spec.priorities, spec.router.port
    else:  # no manifest: the router's own defaults, the same as the schema's
        dispatch = DispatchSpec("llumnix", DEFAULT_BUSY_FREENESS, 1)
        priorities = PrioritiesSpec(DEFAULT_HIGH_PRIORITY_TARGET_TOKENS, "x-llumnix-priority")
        port = 8000
    api = ApiSettings(
        model=model,
        limits=RequestLimits(args.max_body_bytes, args.max_tokens, args.max_prompt_tokens),
        priorities=PrioritySettings(_first(args.priority_header, priorities.header).lower(),
                                    args.priority_field),
        generation=GenerationLimits(args.max_attempts, args.max_model_len),
    )
    return RouterConfig(
        api=api,
        host=args.host,
        port=_first(args.port, port),
        dispatch_policy=_first(args.dispatch_policy, dispatch.policy),
        busy_freeness=float(_first(args.busy_freeness, dispatch.busy_freeness)),
        top_k=_first(args.top_k, dispatch.top_k),
        prefix_weight=float(_first(args.prefix_weight, dispatch.prefix_weight)),
        tokenizer=args.tokenizer,
        load_model=LoadModelConfig(_first(args.high_priority_target_tokens, priorities.target_load_tokens)),
        queue_capacity=args.queue_size,
        queue_timeout_s=args.queue_timeout,
        api_keys=load_api_keys(args.api_keys_file),
        shutdown_grace_s=args.shutdown_grace,
        # The llumlets' credential: from the environment (a Secret), never a flag that `ps` shows.
        service_token=ServiceToken.from_environment(),
    )


def build_source(args: argparse.Namespace) -> InstanceSource:
    if args.instances_dns is not None:
        return DnsInstanceSource.parse(args.instances_dns)
    if args.instances_file is not None:
        source = FileInstanceSource(args.instances_file)
        source.read()  # a missing or malformed file is a start-up error, not a silent empty service
        return source
    return ListInstanceSource(parse_addresses(args.instances))


def run(args: argparse.Namespace) -> int:
    configure_json_logging(f"router-{socket.gethostname()}", args.log_level)
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        config = build_config(args)
        source = build_source(args)
    except (ValueError, SpecError) as exc:
        print(f"llumnix router: {exc}")
        return 2
    try:
        if args.workers > 1:
            return _run_workers(args, config)
        uvloop.run(Router(config, source).serve_until_signal())
    except OSError as exc:
        print(f"llumnix router: {exc}")
        return 1
    return 0


def _run_workers(args: argparse.Namespace, config: RouterConfig) -> int:
    shared_metrics = workers.metrics_dir()
    reserved = workers.reserve_port(config.host, config.port)
    try:
        return workers.supervise(args.workers, reserved.getsockname()[1], functools.partial(_worker, args))
    finally:
        reserved.close()
        shutil.rmtree(shared_metrics, ignore_errors=True)


def _worker(args: argparse.Namespace, port: int) -> None:
    """One worker process (spawned): the router, on the supervisor's port."""
    configure_json_logging(f"router-{socket.gethostname()}-{os.getpid()}", args.log_level)
    config = replace(build_config(args), port=port, reuse_port=True)
    uvloop.run(Router(config, build_source(args)).serve_until_signal())
