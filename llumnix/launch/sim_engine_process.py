"""Run a sim engine as a child process (tests, benchmarks, local mode with `engine: sim`). The same
interface as `llumnix.launch.engine_process.EngineProcess`, so `llumnix.launch.pair.EnginePair`
starts either one next to a llumlet:

    engine = SimEngineProcess("sim-0", port, work_dir / "engine.log", "ipc:///tmp/sim-0.sock",
                              flags=("--time-scale", "10"))
    await engine.start()         # returns once /health answers
    ...                          # engine.url
    await engine.stop()          # SIGTERM, then SIGKILL
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

from llumnix.launch.engine_process import log_tail, wait_healthy


class SimEngineProcess:
    """One `python -m llumnix.sim_engine` process in its own process group."""

    def __init__(self, engine_id: str, port: int, log_path: Path, snapshot_addr: str | None = None,
                 flags: Sequence[str] = (), host: str = "127.0.0.1") -> None:
        self.engine_id = engine_id
        self.port = port
        self.host = host
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.snapshot_addr = snapshot_addr
        self.flags = tuple(flags)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "llumnix.sim_engine", "--host", self.host, "--port", str(self.port),
                # unique per start: a llumlet ignores steps that do not advance for the same engine id
                "--engine-id", f"{self.engine_id}-{time.time_ns()}", "--log-level", "warning"]
        if self.snapshot_addr:
            argv += ["--snapshot-addr", self.snapshot_addr]
        return argv + list(self.flags)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Spawn the engine and return once `/health` answers 200."""
        if self._proc is not None:
            raise RuntimeError("engine already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            await wait_healthy(self.url, lambda: self.returncode, timeout_s,
                               f"sim engine {self.engine_id}", self.log_path)
        except BaseException:
            await self.stop()
            raise

    async def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        return await asyncio.to_thread(proc.wait)

