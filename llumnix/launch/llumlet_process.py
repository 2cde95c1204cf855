"""Run a llumlet as a child process (tests, benchmarks, local mode): a
`llumnix.launch.child_process.ChildProcess` running `python -m llumlet ...`. Start it, wait until it
serves, stop it with SIGTERM (its graceful shutdown), then SIGKILL if it hangs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from llumnix.launch.child_process import ChildCommand, ChildProcess, ChildStartError
from llumnix.service_token import SERVICE_TOKEN_ENV, ServiceToken


class LlumletStartError(ChildStartError):
    """The llumlet exited or did not serve in time; the message ends with its log tail."""


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
    service_token: ServiceToken | None = None
    """Required of the llumlet's callers; None: it serves anyone (`--allow-unauthenticated`)."""

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
            *(() if self.service_token is not None else ("--allow-unauthenticated",)),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        # The token travels in the environment, never in argv; none overrides one this process has.
        token = {SERVICE_TOKEN_ENV: ""} if self.service_token is None else self.service_token.environment()
        return {"PYTHONUNBUFFERED": "1", **token}


class LlumletProcess(ChildProcess):
    start_error = LlumletStartError

    def __init__(self, config: LlumletProcessConfig) -> None:
        self.config = config
        # A stop waits for the llumlet's own graceful shutdown, plus a margin.
        super().__init__(f"llumlet {config.instance_id}", config.log_path, f"{self.http_url}/health",
                         grace_s=config.shutdown_grace_s + 5.0)

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    def start(self) -> None:
        """Spawn the llumlet; `wait_ready` waits until it serves."""
        self.spawn(ChildCommand(self.config.command(), self.config.environment()))

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until /health answers 200: serving, which includes its engine being healthy."""
        await self.wait_healthy(timeout_s)

    async def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait for the graceful shutdown (None: grace period + a margin), then SIGKILL."""
        return await self.terminate(timeout_s)
