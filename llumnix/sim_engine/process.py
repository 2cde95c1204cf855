"""Run a sim engine, or a sim engine with its llumlet, as child processes (tests, benchmarks, local
mode with `engine: sim`):

    instance = SimInstanceProcess("sim-0", work_dir, engine_flags=("--time-scale", "10"))
    await instance.start()       # engine healthy, then llumlet serving
    ...                          # instance.engine_url, instance.llumlet.grpc_address
    instance.kill_engine()       # a crash (failure tests)
    await instance.stop()        # llumlet (graceful), then engine
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from llumlet.llumlet_process import LlumletProcess, LlumletProcessConfig
from llumlet.pair import free_port


class SimEngineStartError(RuntimeError):
    """The sim engine exited or did not answer /health in time; the message ends with its log tail."""


class SimEngineProcess:
    """One `python -m llumnix.sim_engine` process in its own process group."""

    def __init__(self, engine_id: str, log_path: Path, snapshot_addr: str | None = None,
                 flags: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine_id = engine_id
        self.log_path = log_path
        self.snapshot_addr = snapshot_addr
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.flags = tuple(flags)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "llumnix.sim_engine", "--host", self.host, "--port", str(self.port),
                # unique per start: a llumlet ignores steps that do not advance for the same engine id
                "--engine-id", f"{self.engine_id}-{time.time_ns()}", "--log-level", "warning"]
        if self.snapshot_addr:
            argv += ["--snapshot-addr", self.snapshot_addr]
        return argv + list(self.flags)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    async def wait_healthy(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while True:
                if self.process is None or self.process.poll() is not None:
                    raise SimEngineStartError(f"sim engine {self.engine_id} exited during start-up:\n"
                                              f"{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise SimEngineStartError(f"sim engine {self.engine_id} not healthy after "
                                              f"{timeout_s:.0f} s:\n{self.log_tail()}")
                await asyncio.sleep(0.05)

    async def start(self, timeout_s: float = 30.0) -> None:
        self.launch()
        await self.wait_healthy(timeout_s)

    def kill(self) -> None:
        """SIGKILL (a crash, for failure tests)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.kill()
        return await asyncio.to_thread(proc.wait)


class SimInstanceProcess:
    """A sim engine and its llumlet: one instance of a service, as processes."""

    def __init__(self, instance_id: str, work_dir: Path, engine_flags: Sequence[str] = (),
                 host: str = "127.0.0.1", shutdown_grace_s: float = 10.0,
                 llumlet_flags: Sequence[str] = ()) -> None:
        self.instance_id = instance_id
        self.work_dir = work_dir
        snapshot_addr = f"ipc://{work_dir / f'{instance_id}.sock'}"
        self.engine = SimEngineProcess(instance_id, work_dir / f"{instance_id}-engine.log", snapshot_addr,
                                       engine_flags, host)
        self.llumlet = LlumletProcess(LlumletProcessConfig(
            instance_id=instance_id, engine_url=self.engine.url, snapshot_addr=snapshot_addr,
            http_port=free_port(host), grpc_port=free_port(host),
            log_path=work_dir / f"{instance_id}-llumlet.log", host=host,
            shutdown_grace_s=shutdown_grace_s, extra_args=tuple(llumlet_flags)))

    @property
    def engine_url(self) -> str:
        return self.engine.url

    @property
    def grpc_address(self) -> str:
        return self.llumlet.grpc_address

    def launch(self) -> None:
        """Both processes, without waiting (start many instances at once, then `wait_ready`)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.llumlet.start()
        self.engine.launch()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        try:
            await self.engine.wait_healthy(timeout_s)
            await self.llumlet.wait_ready(timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def start(self, timeout_s: float = 60.0) -> None:
        self.launch()
        await self.wait_ready(timeout_s)

    def kill_engine(self) -> None:
        self.engine.kill()

    async def stop(self) -> None:
        await self.llumlet.stop()
        await self.engine.stop()
