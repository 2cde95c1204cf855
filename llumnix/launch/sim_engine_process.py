"""Run a sim engine as a child process (tests, benchmarks, local mode with `engine: sim`). A
`llumnix.launch.child_process.ChildProcess` with the same interface as
`llumnix.launch.engine_process.EngineProcess`, so `llumnix.launch.pair.EnginePair` starts either one
next to a llumlet:

    engine = SimEngineProcess("sim-0", port, work_dir / "engine.log", "ipc:///tmp/sim-0.sock",
                              flags=("--time-scale", "10"))
    await engine.start()         # returns once /health answers
    ...                          # engine.url
    await engine.stop()          # SIGTERM, then SIGKILL
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from llumnix.launch.child_process import ChildCommand, ChildProcess
from llumnix.launch.engine_process import EngineStartError

STOP_GRACE_S = 5.0


class SimEngineProcess(ChildProcess):
    """One `python -m llumnix.sim_engine` process in its own process group."""

    start_error = EngineStartError

    def __init__(self, engine_id: str, port: int, log_path: Path, snapshot_addr: str | None = None,
                 flags: Sequence[str] = (), host: str = "127.0.0.1") -> None:
        self.engine_id = engine_id
        self.port = port
        self.host = host
        self.url = f"http://{host}:{port}"
        self.snapshot_addr = snapshot_addr
        self.flags = tuple(flags)
        super().__init__(f"sim engine {engine_id}", log_path, f"{self.url}/health", grace_s=STOP_GRACE_S)

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "llumnix.sim_engine", "--host", self.host, "--port", str(self.port),
                # unique per start: a llumlet ignores steps that do not advance for the same engine id
                "--engine-id", f"{self.engine_id}-{time.time_ns()}", "--log-level", "warning"]
        if self.snapshot_addr:
            argv += ["--snapshot-addr", self.snapshot_addr]
        return argv + list(self.flags)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Spawn the engine and return once `/health` answers 200."""
        await self.launch(ChildCommand(self.command()), timeout_s)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns the exit code."""
        return await self.terminate(grace_s)
