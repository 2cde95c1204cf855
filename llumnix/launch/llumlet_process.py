"""Run a llumlet as a child process (tests, benchmarks, local mode): start it, wait until it serves,
stop it with SIGTERM (its graceful shutdown), then SIGKILL if it hangs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from llumnix.launch.engine_process import log_tail


class LlumletStartError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class LlumletProcessConfig:
    instance_id: str
    engine_url: str
    snapshot_addr: str
    http_port: int
    grpc_port: int
    log_path: Path
    host: str = "127.0.0.1"
    shutdown_grace_s: float = 30.0
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    module: str = "llumlet"
    """What `python -m` runs: the llumlet, or a module that wraps its CLI (the fault-injection tests')."""

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", self.module,
            "--instance-id", self.instance_id,
            "--engine-url", self.engine_url,
            "--snapshot-addr", self.snapshot_addr,
            "--host", self.host,
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            "--shutdown-grace", str(self.shutdown_grace_s),
            *self.extra_args,
        ]


class LlumletProcess:
    def __init__(self, config: LlumletProcessConfig) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    def start(self) -> None:
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.config.log_path, "ab") as log:
            self.process = subprocess.Popen(self.config.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until /health answers (200, or 503 only because the engine is not healthy yet)."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process is None:
                    raise LlumletStartError(f"llumlet {self.config.instance_id} was never started")
                if (code := self.process.poll()) is not None:
                    raise LlumletStartError(f"llumlet {self.config.instance_id} exited with code {code} "
                                            f"during start:\n{self.log_tail()}")
                try:
                    async with session.get(self.http_url + "/health",
                                           timeout=aiohttp.ClientTimeout(total=2)) as response:
                        if response.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
                await asyncio.sleep(0.1)
        raise LlumletStartError(f"llumlet {self.config.instance_id} not healthy after {timeout_s} s:\n"
                                f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.config.log_path, lines)

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    async def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait for the graceful shutdown (grace period + a margin), then SIGKILL."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        wait_s = self.config.shutdown_grace_s + 5.0 if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.process.poll() is None:
            self.signal(signal.SIGKILL)
            await asyncio.to_thread(self.process.wait)
        return self.process.returncode
