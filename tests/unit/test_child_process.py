"""The generic child-process manager, with `python -c`-sized children: an HTTP server whose /health
answers 200, optionally ignoring SIGTERM or forking a grandchild into its process group."""

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
from waiting import wait_until

from llumnix.launch.child_process import ChildCommand, ChildProcess, ChildStartError
from llumnix.launch.pair import free_port
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc

HEALTH_SERVER = """
import http.server, signal, subprocess, sys
port, ignore_term, grandchild_pid_file = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if grandchild_pid_file:
    # A grandchild that outlives its parent's SIGTERM, like vLLM's engine core.
    grandchild = subprocess.Popen([sys.executable, "-c",
                                   "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "time.sleep(600)"])
    open(grandchild_pid_file, "w").write(str(grandchild.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

ChildFactory = Callable[..., ChildProcess]


@pytest.fixture
async def make_child(tmp_path: Path) -> AsyncIterator[ChildFactory]:
    """ChildProcess objects on a free port each, terminated after the test whatever it left running."""
    children: list[ChildProcess] = []

    def make(grace_s: float = 5.0) -> ChildProcess:
        child = ChildProcess(f"test child {len(children)}", tmp_path / f"child-{len(children)}.log",
                             f"http://127.0.0.1:{free_port()}/health", grace_s=grace_s)
        children.append(child)
        return child

    yield make
    for child in children:
        await child.terminate(grace_s=0)


def server_command(child: ChildProcess, *, ignore_term: bool = False, grandchild_pid_file: Path | None = None,
                   ) -> ChildCommand:
    """The health server on the port of `child`'s health URL."""
    port = urlsplit(child.health_url).port
    return ChildCommand((sys.executable, "-c", HEALTH_SERVER, str(port), "1" if ignore_term else "0",
                         str(grandchild_pid_file or "")))


def is_gone(pid: int) -> bool:
    """No such process, or a zombie waiting for whoever adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_launch_returns_once_healthy_and_terminate_stops_it(make_child: ChildFactory):
    child = make_child()
    assert child.pid is None and child.returncode is None
    await child.launch(server_command(child), timeout_s=30)
    assert child.pid is not None and child.returncode is None
    assert os.getpgid(child.pid) == child.pid  # its own process group
    assert "serving" in child.log_tail()
    assert await child.terminate() == -signal.SIGTERM
    assert child.returncode == -signal.SIGTERM
    assert await child.terminate() == -signal.SIGTERM  # a second stop is a no-op


async def test_exit_during_start_reports_the_log_tail_and_the_command_settings(make_child: ChildFactory,
                                                                               tmp_path: Path):
    child = make_child()
    report = ("import os, sys; print('fatal:', os.environ['CHILD_SETTING'], os.getcwd(), os.nice(0)); "
              "sys.exit(3)")
    command = ChildCommand((sys.executable, "-c", report), env={"CHILD_SETTING": "on"}, cwd=tmp_path, nice=2)
    with pytest.raises(ChildStartError, match=rf"(?s)test child 0 exited with code 3 during start-up.*"
                                              rf"fatal: on {tmp_path} {os.nice(0) + 2}"):
        await child.launch(command, timeout_s=30)


async def test_not_healthy_in_time_is_an_error_and_the_child_is_stopped(make_child: ChildFactory):
    child = make_child()
    sleeper = ChildCommand((sys.executable, "-c",
                            "import time; print('starting', flush=True); time.sleep(600)"))
    with pytest.raises(ChildStartError, match=r"(?s)not healthy after 1 s.*starting"):
        await child.launch(sleeper, timeout_s=1)
    assert child.returncode == -signal.SIGTERM


async def test_sigterm_ignored_means_sigkill_after_the_grace(make_child: ChildFactory):
    child = make_child(grace_s=0.5)
    await child.launch(server_command(child, ignore_term=True), timeout_s=30)
    started = time.monotonic()
    assert await child.terminate() == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5


async def test_stop_reaches_a_grandchild_that_outlives_its_parent(make_child: ChildFactory, tmp_path: Path):
    child = make_child()
    pid_file = tmp_path / "grandchild.pid"
    await child.launch(server_command(child, grandchild_pid_file=pid_file), timeout_s=30)
    grandchild = int(pid_file.read_text())
    assert os.getpgid(grandchild) == child.pid
    assert await child.terminate() == -signal.SIGTERM  # the parent obeys; the grandchild ignores SIGTERM
    # SIGKILL is delivered at once, but a loaded machine may take a moment to reap the grandchild.
    await wait_until(lambda: is_gone(grandchild), f"grandchild {grandchild} gone after its group's SIGKILL")


async def test_signal_goes_to_the_group_and_is_a_no_op_once_exited(make_child: ChildFactory):
    child = make_child()
    await child.launch(server_command(child), timeout_s=30)
    child.signal(signal.SIGKILL)
    assert await child.terminate() == -signal.SIGKILL
    child.signal(signal.SIGTERM)


async def test_one_spawn_per_object_and_no_wait_before_it(make_child: ChildFactory):
    child = make_child()
    with pytest.raises(ChildStartError, match="never started"):
        await child.wait_healthy(timeout_s=1)
    assert await child.terminate() is None
    child.spawn(server_command(child))
    with pytest.raises(RuntimeError, match="already started"):
        child.spawn(server_command(child))


async def test_niced_children_start_while_this_process_is_busy_with_grpc(make_child: ChildFactory):
    """Local mode starts CPU engines (niced) beside the control loop's gRPC streams. A child that ran
    Python between fork and exec (a preexec_fn) was crashed there by gRPC's fork handlers (SIGSEGV in
    about one start in four); `nice` runs nothing of Python before the exec."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = llumlet_pb2_grpc.LlumletStub(channel)
    busy = True

    async def call_while_busy() -> None:
        while busy:
            with contextlib.suppress(grpc.aio.AioRpcError):  # UNIMPLEMENTED: a call is what counts
                await stub.GetLoad(pb.GetLoadRequest())

    callers = [asyncio.create_task(call_while_busy()) for _ in range(4)]
    try:
        codes = []
        for _ in range(30):
            child = make_child()
            niced = f"import os; assert os.nice(0) == {os.nice(0) + 1}"
            child.spawn(ChildCommand((sys.executable, "-c", niced), nice=1))
            await wait_until(lambda child=child: child.returncode is not None, f"{child.name} to exit")
            codes.append(child.returncode)
        assert codes == [0] * 30
    finally:
        busy = False
        await asyncio.gather(*callers)
        await channel.close()
        await server.stop(None)


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="this kernel does not group tasks by session (no sched_autogroup)")
async def test_a_niced_child_nices_its_own_session_where_the_kernel_groups_by_session(
        make_child: ChildFactory) -> None:
    """Under sched_autogroup niceness weighs only inside a session, and the child's is its own: the
    increment is set on the session's group too, which its children share."""
    child = make_child()
    child.spawn(ChildCommand((sys.executable, "-c", "import time; time.sleep(600)"), nice=3))
    try:
        child_group = Path(f"/proc/{child.pid}/autogroup").read_text().split()
        assert child_group[-1] == "3"
        # This session is untouched. A session left in the root task group (a runner that never called
        # setsid) has no autogroup of its own, and the kernel prints nothing for it.
        own_group = Path("/proc/self/autogroup").read_text().split()
        assert not own_group or (own_group[0] != child_group[0] and own_group[-1] != "3")
    finally:
        await child.terminate(grace_s=5)
