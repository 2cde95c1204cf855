"""One child process that serves HTTP: spawned in its own process group with its output in a log file,
ready once its health URL answers 200, stopped with SIGTERM to the group, then SIGKILL. The vLLM
engine, the sim engine and the llumlet launchers (`engine_process`, `sim_engine_process`,
`llumlet_process`) are this plus the command they build:

    child = ChildProcess("sim engine a", work_dir / "engine.log", "http://127.0.0.1:8001/health",
                         grace_s=5)
    await child.launch(ChildCommand(argv=(...)), timeout_s=30)   # spawn, then wait until healthy
    ...                                                          # child.pid, child.returncode
    await child.terminate()                                      # the exit code

A start-up failure raises `start_error` (a `ChildStartError`) whose message ends with the log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import aiohttp

START_ERROR_LOG_LINES = 40
logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
HEALTH_POLL_INTERVAL_S = 0.1
HEALTH_REQUEST_TIMEOUT_S = 2.0


class ChildStartError(RuntimeError):
    """The child exited or did not become healthy in time; the message ends with its log tail."""


@dataclass(frozen=True, slots=True)
class ChildCommand:
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to (and overriding) this process's environment."""
    cwd: Path | None = None
    nice: int = 0
    """Niceness increment, applied before exec so that the child's own children inherit it."""

    def launch_argv(self) -> list[str]:
        """What is executed: `argv`, under `nice` when there is an increment. No Python may run between
        fork and exec (a `preexec_fn`): in a parent with gRPC threads (the control loop's), gRPC's fork
        handlers crash the child with SIGSEGV before it ever starts."""
        argv = [str(arg) for arg in self.argv]
        return ["nice", "-n", str(self.nice), *argv] if self.nice else argv


def _set_autogroup_nice(pid: int, nice: int) -> None:
    """Where the kernel groups tasks by session (`sched_autogroup`), niceness counts only inside a
    session, and the child's session is its own: the whole group gets the increment, or the engines'
    niceness would weigh nothing against the llumlets'. A kernel without autogroup: nothing to do."""
    path = Path(f"/proc/{pid}/autogroup")
    for _ in range(3):  # unprivileged writers may change one autogroup per 100 ms (EAGAIN)
        try:
            path.write_text(str(nice))
            return
        except BlockingIOError:
            time.sleep(0.11)
        except OSError:
            return
    logger.warning("the child's session could not be niced", extra={"pid": pid, "nice": nice})


class ChildProcess:
    """One child process in its own process group, so that a stop reaches whatever it forks."""

    start_error: ClassVar[type[ChildStartError]] = ChildStartError

    def __init__(self, name: str, log_path: Path, health_url: str, grace_s: float) -> None:
        self.name = name
        """For error messages, e.g. "engine on port 8101"."""
        self.log_path = log_path
        self.health_url = health_url
        self.grace_s = grace_s
        """How long a stop waits after SIGTERM before SIGKILL (unless told otherwise)."""
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen else None

    def log_tail(self, lines: int = START_ERROR_LOG_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def spawn(self, command: ChildCommand) -> None:
        """Start the process (once per object); returns at once."""
        if self._popen is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                command.launch_argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **command.env},
                cwd=command.cwd,
                start_new_session=True,
            )
        if command.nice:
            _set_autogroup_nice(self._popen.pid, command.nice)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Until the health URL answers 200; `start_error` when the process exits or `timeout_s` passes."""
        if self._popen is None:
            raise self.start_error(f"{self.name} was never started")
        deadline = time.monotonic() + timeout_s
        request_timeout = aiohttp.ClientTimeout(total=HEALTH_REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=request_timeout) as session:
            while True:
                code = self.returncode
                if code is not None:
                    raise self._start_failure(f"exited with code {code} during start-up")
                with contextlib.suppress(aiohttp.ClientError, OSError):  # OSError covers TimeoutError
                    async with session.get(self.health_url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise self._start_failure(f"not healthy after {timeout_s:.0f} s")
                await asyncio.sleep(HEALTH_POLL_INTERVAL_S)

    async def launch(self, command: ChildCommand, timeout_s: float) -> None:
        """`spawn`, then `wait_healthy`; a failure (or cancellation) terminates the process first."""
        self.spawn(command)
        try:
            await self.wait_healthy(timeout_s)
        except BaseException:
            await self.terminate()
            raise

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group while the process runs."""
        if self._popen is not None and self._popen.poll() is None:
            self._signal_group(sig)

    async def terminate(self, grace_s: float | None = None) -> int | None:
        """SIGTERM to the group, SIGKILL after `grace_s` (None: `self.grace_s`); returns the exit code
        (None if never spawned)."""
        popen = self._popen
        if popen is None:
            return None
        if popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            if not await self._exits_within(self.grace_s if grace_s is None else grace_s):
                self._signal_group(signal.SIGKILL)
                await self._exits_within(None)
        # Children that outlive the leader (vLLM's engine core) are still in its group.
        self._signal_group(signal.SIGKILL)
        return popen.returncode

    def _signal_group(self, sig: int) -> None:
        assert self._popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, sig)

    async def _exits_within(self, timeout_s: float | None) -> bool:
        """Whether the process exits within `timeout_s` (None: wait as long as it takes)."""
        assert self._popen is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._popen.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_INTERVAL_S)
        return True

    def _start_failure(self, what: str) -> ChildStartError:
        return self.start_error(f"{self.name} {what}; log {self.log_path}:\n"
                                f"{self.log_tail(START_ERROR_LOG_LINES)}")
