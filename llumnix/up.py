"""Run a whole LLMService on this machine, no Kubernetes: its engines with their llumlets (local
processes), the router, the control loop (migration, autoscaling, replacement) and the admin API.

    llumnix up -f deploy/examples/local-sim.yaml              # serve until Ctrl-C / SIGTERM
    llumnix up -f deploy/examples/local-cpu.yaml --demo       # start, run a short workload, print, stop

The manifest is the same `LLMService` the operator reconciles. Runtime `vllm-cpu` without
`model.path` serves a tiny random model built on the fly (`llumnix make-tiny-model`, cached under
--model-cache); runtime `sim` runs simulated engines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import uvloop
from aiohttp import web
from tqdm import tqdm

from llumnix.bench import BenchConfig, format_summary, run_bench
from llumnix.control.admin_api import admin_app
from llumnix.control.local_backend import LocalProcessBackend, pair_config
from llumnix.control.loop import ControlLoop
from llumnix.control.migration_pass import outcome_name
from llumnix.control.router_queues import RouterQueues
from llumnix.control.status import FREENESS_MEANING, ControlEvent, InstanceStatus, ServiceStatus, headroom
from llumnix.jsonlog import configure_json_logging
from llumnix.llumlet_client import LlumletConnection
from llumnix.router import cli as router_cli
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router, RouterConfig
from llumnix.service_spec import ServiceSettings, SpecError, load_service_file
from llumnix.service_token import ServiceToken
from llumnix.tiny_model import PRESETS, ensure_tiny_model
from llumnix.traces import TRACE_PRESETS, generate_trace

DEFAULT_ADMIN_PORT = 8090
DEMO_REQUESTS = 24
MIN_OUTPUT_TOKENS = 8
"""Workload requests generate at least this many tokens: a single token of a random tiny model can
decode to no text, which a client cannot tell from a request that produced nothing."""
GIVE_UP_AFTER_FAILURES = 3
"""Per desired instance: this many failed starts before the service ever served ends `up`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="LLMService manifest (YAML)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="router and admin listen address (default: %(default)s)")
    parser.add_argument("--port", type=int,
                        help="router port (default: the manifest's router.port; 0: any free)")
    parser.add_argument("--admin-port", type=int, default=DEFAULT_ADMIN_PORT,
                        help="admin API port (`llumnix admin`; default: %(default)s; 0: any free)")
    parser.add_argument("--work-dir", type=Path,
                        help="engine and llumlet logs (default: a new temporary directory)")
    parser.add_argument("--model-cache", type=Path, default=Path(".cache/models"),
                        help="where the tiny model is built (default: %(default)s)")
    parser.add_argument("--demo", action="store_true",
                        help=f"run a short workload ({DEMO_REQUESTS} requests, at least one migration), "
                        "print a summary and stop")
    parser.add_argument("--workload", type=int, default=0, metavar="N",
                        help="once serving, send N requests through the router and print a summary")
    parser.add_argument("--then-stop", action="store_true", help="stop after the workload")
    parser.add_argument("--trace", default="S-S", choices=list(TRACE_PRESETS),
                        help="workload length distribution (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=4.0,
                        help="workload requests per second (default: %(default)s)")
    parser.add_argument("--max-total-tokens", type=int, default=256,
                        help="workload cap on prompt + output tokens per request (default: %(default)s)")
    parser.add_argument("--status-interval", type=float, default=1.0, metavar="S",
                        help="seconds between status lines (default: %(default)s)")
    parser.add_argument("--log-level", default="error", choices=["debug", "info", "warning", "error"],
                        help="JSON logs on stderr (default: %(default)s; the control loop's events are "
                        "printed anyway)")


def instance_headroom(instance: InstanceStatus) -> str:
    return headroom(instance.freeness, instance.block_size, idle=instance.idle, draining=instance.draining)


def status_line(status: ServiceStatus, in_flight: int) -> str:
    rooms = ", ".join(f"{i.instance_id.rsplit('-', 1)[-1]}:{instance_headroom(i)}" for i in status.instances)
    aggregate = headroom(status.aggregate_freeness, status.block_size, idle=status.idle)
    running = sum(i.running for i in status.instances)
    waiting = sum(i.waiting for i in status.instances)
    migrations = sum(v for k, v in status.migrations.items() if k == "committed")
    return (f"{status.ready}/{status.desired} ready | headroom {rooms or '-'} (aggregate {aggregate}) | "
            f"running {running} waiting {waiting} in-flight {in_flight} | migrations {migrations}")


def print_event(event: ControlEvent) -> None:
    where = f" {event.instance_id}" if event.instance_id else ""
    stream = sys.stderr if event.kind == "Warning" else sys.stdout
    print(f"[{event.reason}]{where}: {event.message}", file=stream, flush=True)


def router_config(service_file: str, host: str, port: int | None, max_model_len: int | None,
                  dispatch_policy: str | None = None) -> RouterConfig:
    """The router's configuration from the manifest, exactly as `llumnix router --service` reads it
    (`max_model_len` None: the engines take the model's, unknown to the router)."""
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    argv = ["--service", service_file, "--host", host, "--shutdown-grace", "5"]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if port is not None:
        argv += ["--port", str(port)]
    if dispatch_policy is not None:
        argv += ["--dispatch-policy", dispatch_policy]
    return router_cli.build_config(parser.parse_args(argv))


class LocalService:
    """Backend, router, control loop and admin API, started and stopped together."""

    def __init__(self, service_file: str, work_dir: Path, model_dir: Path | None, *, host: str = "127.0.0.1",
                 port: int | None = None, admin_port: int = 0, dispatch_policy: str | None = None,
                 on_event: Callable[[ControlEvent], None] = print_event) -> None:
        self.service_file = service_file
        self.settings = settings = load_service_file(service_file)
        # One credential per run, as the operator keeps one per service: every llumlet requires it and
        # the router and the control loop present it; it reaches the llumlets in their environment.
        self.token = token = ServiceToken.generate()
        self.backend = LocalProcessBackend(settings, work_dir, model_dir, token=token)
        engine = pair_config(settings, "check", work_dir, model_dir)
        self.source = ListInstanceSource()
        # The engines' own model folder: the router tokenizes text and chat prompts with it, so that
        # prefix-aware dispatch looks them up (the sim engine has no model folder).
        tokenizer = (str(engine.model_dir) if engine.model_dir is not None and engine.model_dir.is_dir()
                     and settings.spec.dispatch.prefix_weight > 0 else None)
        config = router_config(service_file, host, port, engine.max_model_len, dispatch_policy)
        self.router = Router(replace(config, service_token=token, tokenizer=tokenizer), self.source)
        self.loop = ControlLoop(settings, self.backend, on_event=on_event,
                                connect=functools.partial(LlumletConnection, token=token),
                                on_addresses=self.source.set_addresses,
                                router_queues=RouterQueues(self._router_urls, token))
        self.admin = web.AppRunner(admin_app(self.loop), access_log=None)
        self.admin_host, self.admin_port = host, admin_port
        self._loop_task: asyncio.Task[None] | None = None

    async def _router_urls(self) -> list[str]:
        return [self.router.url]

    async def start(self) -> None:
        await self.router.start()
        await self.admin.setup()
        site = web.TCPSite(self.admin, self.admin_host, self.admin_port)
        try:
            await site.start()
        except OSError as exc:
            raise OSError(f"cannot listen on {self.admin_host}:{self.admin_port} for the admin API: "
                          f"{exc.strerror or exc}") from None
        self.admin_port = self.admin.addresses[0][1]
        self._loop_task = asyncio.create_task(self.loop.run(), name="control-loop")

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"

    def serving(self) -> bool:
        status = self.loop.status()
        return status.serving >= status.desired and \
            len(self.router.instances.dispatchable()) >= status.desired

    async def wait_serving(self, stop: asyncio.Event) -> bool:
        """Until every desired instance serves through the router (False: stopped, or starts keep failing)."""
        desired = self.loop.desired
        with tqdm(total=desired, desc="starting instances", unit="inst", file=sys.stdout) as bar:
            while not stop.is_set():
                status = self.loop.status()
                bar.n = min(len(self.router.instances.dispatchable()), status.desired)
                bar.total = status.desired
                bar.refresh()
                if self.serving():
                    return True
                if status.replacements >= GIVE_UP_AFTER_FAILURES * max(1, desired):
                    print(f"llumnix up: instances keep failing to start; see the logs under "
                          f"{self.backend.work_dir}", file=sys.stderr)
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
        return False

    async def shutdown(self) -> None:
        await self.router.shutdown()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        await self.admin.cleanup()
        await self.backend.close()


async def force_migration(service: LocalService, stop: asyncio.Event) -> str:
    """Move one running request through the control loop's migrate() (what `llumnix admin migrate`
    does) unless the migration policy already moved one; returns what happened, for the summary."""
    loop = service.loop
    last = "no request was running long enough to migrate"
    while not stop.is_set():
        if loop.migration_outcomes.get("committed"):
            return "the migration policy moved requests on its own"
        status = loop.status()
        serving = [i for i in status.instances if i.phase == "ready" and not i.draining]
        busiest = max(serving, key=lambda i: i.running, default=None)
        if busiest is not None and busiest.running > 0 and len(serving) > 1:
            destination = max((i for i in serving if i is not busiest), key=lambda i: i.freeness or 0.0)
            try:
                result = await loop.migrate(None, busiest.instance_id, destination.instance_id)
            except Exception as exc:  # report whatever stopped it; the workload goes on
                return f"migration through the control loop failed: {exc}"
            outcome = outcome_name(result.outcome)
            last = (f"migrated request {result.request_id} from {busiest.instance_id} to "
                    f"{destination.instance_id}: {outcome}")
            if outcome == "committed":
                return (f"{last} ({result.migrated_tokens} tokens of KV moved, downtime "
                        f"{result.downtime_ms:.1f} ms)")
            last += f" ({result.reason})"
            await asyncio.sleep(1.0)  # let the request run on before trying again
        await asyncio.sleep(0.2)
    return last


async def run_workload(service: LocalService, args: argparse.Namespace, requests: int, demo: bool) -> bool:
    trace = [replace(r, output_tokens=max(r.output_tokens, MIN_OUTPUT_TOKENS))
             for r in generate_trace(args.trace, requests, args.rate, 1.0, 0, 0.0, args.max_total_tokens)]
    print(f"workload: {requests} {args.trace} requests at {args.rate:g}/s through {service.router.url}")
    done = asyncio.Event()
    migration = asyncio.create_task(force_migration(service, done)) if demo else None
    try:
        config = BenchConfig(url=service.router.url, model=service.settings.spec.model.name)
        result = await run_bench(config, trace)
    finally:
        done.set()
    note = await migration if migration is not None else None
    summary = result.summary()
    status = service.loop.status()
    print("\nsummary")
    print(format_summary(summary, result.errors_by_kind))
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(status.migrations.items())) or "none"
    print(f"migrations: {outcomes}")
    if note:
        print(f"  {note}")
    print("freeness per instance: " + ", ".join(
        f"{i.instance_id} {instance_headroom(i)}" for i in status.instances))
    print(f"  ({FREENESS_MEANING})")
    return summary["finished"] == summary["requests"]


async def serve(args: argparse.Namespace, settings: ServiceSettings, work_dir: Path, model_dir: Path | None,
                workload: int, then_stop: bool) -> int:
    service = LocalService(args.file, work_dir, model_dir, host=args.host, port=args.port,
                           admin_port=args.admin_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    code = 0
    try:
        await service.start()
        print(f"service {settings.name}: {settings.spec.engine.runtime} engines, logs in {work_dir}")
        if not await service.wait_serving(stop):
            return 0 if stop.is_set() else 1
        print(f"serving {settings.spec.model.name!r} at {service.router.url}/v1 "
              f"(OpenAI API); admin API at {service.admin_url} "
              f"(`llumnix admin --url {service.admin_url} status`)", flush=True)
        if workload:
            code = 0 if await run_workload(service, args, workload, args.demo) else 1
            if then_stop:
                return code
        tty = sys.stdout.isatty()
        while not stop.is_set():
            line = status_line(service.loop.status(), service.router.api.in_flight)
            print(f"\r{line:<100}" if tty else line, end="" if tty else "\n", flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.status_interval)
        if tty:
            print()
        return code
    finally:
        print("stopping...", flush=True)
        await service.shutdown()
        print("stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    configure_json_logging("up", args.log_level)
    try:
        settings = load_service_file(args.file)
        model_dir = None
        if settings.spec.engine.runtime == "vllm-cpu" and not settings.spec.model.path:
            print(f"building the tiny model under {args.model_cache} (once)...", flush=True)
            model_dir = ensure_tiny_model(args.model_cache, PRESETS["test"])
        work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix=f"llumnix-up-{settings.name}-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        pair_config(settings, "check", work_dir, model_dir)
    except SpecError as exc:
        print(f"llumnix up: {exc}", file=sys.stderr)
        return 2
    workload = args.workload or (DEMO_REQUESTS if args.demo else 0)
    try:
        return uvloop.run(serve(args, settings, work_dir.resolve(), model_dir, workload,
                                 args.then_stop or args.demo))
    except OSError as exc:
        print(f"llumnix up: {exc}", file=sys.stderr)
        return 1
