"""The service under test of the chaos and load benchmarks (bench/chaos.py, bench/load.py): the
product's local-mode pieces — engine + llumlet pairs as processes (`LocalProcessBackend`; sim engines,
or CPU vLLM with the tiny model), the control loop (migration, replacement) in this process — and one
or more `llumnix router` processes, so that a router can be killed -9 and restarted like a
Deployment's pod. Every llumlet requires the service token; the routers and the control loop present it.

Also the parts the two benchmarks share: a greedy streaming client whose answers are checked token by
token (against the sim engine's own next-token function, or an unfaulted reference answer), migrations
through the control loop, and reading a process's RSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc

from llumnix.control.local_backend import LocalProcessBackend
from llumnix.control.loop import ControlLoop
from llumnix.control.migration_pass import outcome_name
from llumnix.control.status import ControlEvent
from llumnix.launch.child_process import ChildCommand, ChildProcess
from llumnix.launch.pair import EnginePair, free_port
from llumnix.llumlet_client import LlumletConnection
from llumnix.service_spec import ServiceSettings, load_service_file
from llumnix.service_token import ServiceToken, call_metadata
from llumnix.sim_engine.tokens import TokenGenerator
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

T = TypeVar("T")
RUNTIMES = ("sim", "vllm-cpu")
MODELS = {"sim": "sim", "vllm-cpu": "tiny"}
Expected = tuple[list[int], str]
"""A request's unfaulted answer: its token ids and its text."""
ROUTER_START_TIMEOUT_S = 120.0


def raise_fd_limit() -> int:
    """Soft open-files limit up to the hard one (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of a live process, MiB (None once it is gone)."""
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def write_manifest(path: Path, name: str, instances: int, runtime: str, engine_args: Sequence[str]) -> Path:
    """An LLMService of `instances` engines, migration on, autoscaling off (JSON is YAML)."""
    cpu = runtime == "vllm-cpu"
    manifest = {
        "apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService", "metadata": {"name": name},
        "spec": {
            "model": {"name": MODELS[runtime]},
            # CPU attention needs blocks of a multiple of 32
            "engine": {"runtime": runtime, "blockSize": 32 if cpu else 16, "args": list(engine_args)},
            "instances": {"min": instances, "max": instances},
            "migration": {"enabled": True, "intervalMs": 100, "freenessThreshold": 3},
            # CPU vLLM starts in 20-40 s alone, far slower on a busy machine
            "autoscaling": {"enabled": False, "startupGraceSeconds": 600 if cpu else 60},
            "router": {"port": 8000},
        },
    }
    path.write_text(json.dumps(manifest, indent=2))
    return path


@dataclass(frozen=True)
class _WithLlumletArgs(ServiceSettings):
    """The manifest's settings plus llumlet flags the spec has no field for (longer migrations)."""

    extra_llumlet_args: tuple[str, ...] = ()

    @property
    def llumlet_args(self) -> list[str]:
        return [*super().llumlet_args, *self.extra_llumlet_args]


class RouterReplica:
    """One `llumnix router` process on a fixed port; `restart` starts a new process there (a pod
    replaced by its Deployment). `generation` counts the processes, so a client can tell whether the
    router that took its request is the one still serving."""

    def __init__(self, index: int, manifest: Path, instances_file: Path, token: ServiceToken, work: Path,
                 extra_args: Sequence[str] = ()) -> None:
        self.index = index
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.manifest, self.instances_file, self.token, self.work = manifest, instances_file, token, work
        self.extra_args = tuple(extra_args)
        self.generation = 0
        self.alive = False
        self.process: ChildProcess | None = None

    async def start(self) -> float:
        """Start a process and return the seconds until it serves every instance (its /health is 200)."""
        started = time.monotonic()
        self.generation += 1
        process = ChildProcess(f"router-{self.index}", self.work / f"router-{self.index}.log",
                               f"{self.url}/health", grace_s=10)
        argv = [sys.executable, "-m", "llumnix.cli", "router", "--service", str(self.manifest),
                "--instances-file", str(self.instances_file), "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning", "--queue-size", "4096",
                *self.extra_args]
        self.process = process
        await process.launch(ChildCommand(argv, self.token.environment()), ROUTER_START_TIMEOUT_S)
        self.alive = True
        return time.monotonic() - started

    def kill(self) -> None:
        """kill -9; the clients of this process see their connections drop."""
        self.alive = False
        self.generation += 1
        if self.process is not None:
            self.process.signal(9)

    async def stop(self) -> None:
        self.alive = False
        if self.process is not None:
            await self.process.terminate()

    async def health(self, session: aiohttp.ClientSession) -> dict[str, Any] | None:
        with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
            async with session.get(f"{self.url}/health") as response:
                return await response.json()
        return None


class BenchService:
    """Engine + llumlet pairs under the control loop, and router processes over them."""

    def __init__(self, work: Path, *, name: str, instances: int, routers: int, engine_args: Sequence[str],
                 runtime: str = "sim", model_dir: Path | None = None, llumlet_args: Sequence[str] = (),
                 router_args: Sequence[str] = (),
                 on_event: Callable[[ControlEvent], None] | None = None) -> None:
        """`model_dir`: the model of a vllm-cpu service (`llumnix.tiny_model.ensure_tiny_model`)."""
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.model = MODELS[runtime]
        self.manifest = write_manifest(work / "service.yaml", name, instances, runtime, engine_args)
        loaded = load_service_file(str(self.manifest))
        self.settings = _WithLlumletArgs(loaded.name, loaded.namespace, loaded.spec, tuple(llumlet_args))
        self.token = ServiceToken.generate()
        self.instances_file = work / "instances.txt"
        self.instances_file.write_text("")
        self.backend = LocalProcessBackend(self.settings, work / "instances", model_dir, token=self.token)
        self.events: list[tuple[float, ControlEvent]] = []
        self._on_event = on_event
        self.loop = ControlLoop(self.settings, self.backend, on_event=self._event,
                                connect=functools.partial(LlumletConnection, token=self.token),
                                on_addresses=self._write_addresses, reconcile_interval_s=0.5)
        self.routers = [RouterReplica(i, self.manifest, self.instances_file, self.token, work, router_args)
                        for i in range(routers)]
        self._loop_task: asyncio.Task[None] | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _event(self, event: ControlEvent) -> None:
        self.events.append((time.monotonic(), event))
        if self._on_event is not None:
            self._on_event(event)

    def _write_addresses(self, addresses: frozenset[str]) -> None:
        # Written whole and renamed, so a router never reads half a file.
        staging = self.instances_file.with_suffix(".tmp")
        staging.write_text("".join(f"{a}\n" for a in sorted(addresses)))
        staging.replace(self.instances_file)

    @property
    def desired(self) -> int:
        return self.loop.desired

    async def start(self, session: aiohttp.ClientSession, timeout_s: float = 300.0) -> None:
        self._loop_task = asyncio.create_task(self.loop.run(), name="control-loop")
        await self.wait_serving(session, timeout_s)

    def ready_pairs(self) -> dict[str, EnginePair]:
        """Instance id -> processes, for the instances the control loop holds READY."""
        pairs = {}
        for instance in self.loop.status().instances:
            if instance.phase == "ready" and not instance.draining:
                with contextlib.suppress(KeyError):  # released meanwhile
                    pairs[instance.instance_id] = self.backend.pair(instance.instance_id)
        return pairs

    async def fully_serving(self, session: aiohttp.ClientSession) -> bool:
        """Every desired instance READY, every router started and dispatching to all of them."""
        status = self.loop.status()
        if status.serving < status.desired or len(status.instances) != status.desired:
            return False
        for router in self.routers:
            if not router.alive:
                return False
            health = await router.health(session)
            if health is None or health.get("instances_ready") != status.desired:
                return False
        return True

    async def wait_serving(self, session: aiohttp.ClientSession, timeout_s: float) -> float:
        """Seconds until `fully_serving` (routers not yet started are started); TimeoutError after
        `timeout_s`, naming what is missing."""
        started = time.monotonic()
        while True:
            if self.loop.status().serving >= self.desired:
                for router in self.routers:
                    if router.process is None:
                        await router.start()
            if await self.fully_serving(session):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"service not serving after {timeout_s:.0f} s: {self.loop.status()}")
            await asyncio.sleep(0.1)

    def llumlet(self, address: str) -> llumlet_pb2_grpc.LlumletStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return llumlet_pb2_grpc.LlumletStub(channel)

    async def load(self, pair: EnginePair) -> pb.InstanceLoad:
        return await self.llumlet(pair.grpc_address).GetLoad(pb.GetLoadRequest(), timeout=5,
                                                              metadata=call_metadata(self.token))

    async def close(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.routers), return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        for channel in self._channels.values():
            await channel.close()
        await self.backend.close()


async def metric_values(session: aiohttp.ClientSession, url: str, wanted: Sequence[str]) -> dict[str, float]:
    """The `wanted` series of a /metrics page (one sample each), by name."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def engine_gauges(session: aiohttp.ClientSession, engine_url: str) -> dict[str, float]:
    """The engine's vllm:num_requests_running/waiting and vllm:kv_cache_usage_perc from /metrics."""
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    values = await metric_values(session, engine_url, wanted)
    return {name.split(":", 1)[1]: value for name, value in values.items()}


async def engine_staging(session: aiohttp.ClientSession, pair: EnginePair) -> dict[str, float]:
    """What the engine's migration staging holds (`staged_migrations`, `staging_bytes`), as the engine
    reports it to its llumlet, from the llumlet's /metrics; a series the engine has not reported is
    left out."""
    prefix = "llumnix_llumlet_engine_"
    wanted = (f"{prefix}staged_migrations", f"{prefix}staging_bytes")
    values = await metric_values(session, pair.llumlet.http_url, wanted)
    return {name.removeprefix(prefix): value for name, value in values.items()}


async def migration_outcome(migration: asyncio.Task[mpb.MigrateOutResponse]) -> str:
    """How a migration the control loop ran ended: its outcome, or why the call failed (a killed
    source's call fails, and is cancelled when the control loop drops the dead instance's connection)."""
    await asyncio.wait([migration])
    if migration.cancelled():
        return "call cancelled (instance dropped)"
    exc = migration.exception()
    if exc is not None:
        return f"call failed ({type(exc).__name__})"
    result = migration.result()
    name = outcome_name(result.outcome)
    return f"{name} ({result.reason})" if result.reason else name


async def migrate_busiest(loop: ControlLoop) -> str | None:
    """One migration through the control loop (what `llumnix admin migrate` does) from the instance
    running most requests to the one running fewest; how it ended, or None when nothing runs."""
    serving = sorted((i for i in loop.status().instances if i.phase == "ready" and not i.draining),
                     key=lambda i: (-i.running, i.instance_id))
    if len(serving) < 2 or serving[0].running == 0:
        return None
    source, destination = serving[0].instance_id, serving[-1].instance_id
    return await migration_outcome(asyncio.create_task(loop.migrate(None, source, destination)))


def sim_expected(prompt: Sequence[int], max_tokens: int, seed: int = 0) -> Expected:
    """What a sim engine (seed `seed`, no end-of-sequence) generates for `prompt`: the unfaulted,
    greedy output every request must get, whatever was killed or moved under it."""
    generator = TokenGenerator(seed)
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(generator.next_token(sequence, eos_allowed=False))
    tokens = sequence[len(prompt):]
    return tokens, "".join(map(chr, tokens))


@dataclass
class StreamResult:
    """One streamed completion as the client saw it."""

    status: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    """`data: [DONE]` arrived."""
    error: str | None = None
    """An error the router sent in OpenAI's shape (a non-200 body or an SSE error event)."""
    transport_error: str | None = None
    """The connection failed or dropped (no answer in any shape)."""
    timed_out: bool = False
    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    def complete(self) -> bool:
        """A whole answer: 200, [DONE], no error, finished by length (every request ignores EOS)."""
        return self.status == 200 and self.done and self.error is None and self.finish_reason == "length"

    def matches(self, expected: Expected) -> bool:
        tokens, text = expected
        return self.complete() and self.tokens == tokens and self.text == text


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: Sequence[int],
                            max_tokens: int, deadline_s: float) -> StreamResult:
    """POST a greedy streaming completion (token-id prompt, `return_token_ids`) and read it to its end."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    result = StreamResult(started=time.monotonic())
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(f"{url}/v1/completions", json=body) as response:
                result.status = response.status
                if response.status != 200:
                    result.error = (await response.text())[:300]
                    return result
                async for line in response.content:
                    _read_event(result, line)
    except TimeoutError:
        result.timed_out = True
    except (aiohttp.ClientError, OSError) as exc:
        result.transport_error = f"{type(exc).__name__}: {exc}"[:300]
    result.finished = time.monotonic()
    return result


def _read_event(result: StreamResult, line: bytes) -> None:
    if not line.startswith(b"data: "):
        return
    payload = line[6:].strip()
    if payload == b"[DONE]":
        result.done = True
        return
    event = json.loads(payload)
    if "error" in event:
        result.error = json.dumps(event["error"])[:300]
        return
    for choice in event.get("choices", ()):
        ids = choice.get("token_ids") or []
        if ids and result.first_token is None:
            result.first_token = time.monotonic()
        result.tokens.extend(ids)
        result.text += choice.get("text") or ""
        result.finish_reason = choice.get("finish_reason") or result.finish_reason


def client_session(connections: int = 0) -> aiohttp.ClientSession:
    """A session with no connection cap (0) or `connections`, and no total timeout (each request has its
    own deadline)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=None))


def run_cleanly(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, with SIGTERM taken as Ctrl-C is: `main` is cancelled, so its `finally`
    stops every process the run started instead of leaving them behind."""
    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main

    return asyncio.run(guarded())


def nice_self(increment: int) -> None:
    """Lower this process's priority (and its children's): the benchmarks share the machine."""
    if increment:
        os.nice(increment)
