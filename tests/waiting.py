"""Waiting for a condition in a test: poll it until it holds, or fail loudly naming what was awaited.
For state that announces no event a test could await (a router's queue, its instance set)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

POLL_S = 0.02
T = TypeVar("T")


async def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(POLL_S)


async def wait_until_async(condition: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 30.0,
                           poll_s: float = POLL_S) -> T:
    """`wait_until` for a condition that must itself await (an RPC, an HTTP request); returns its first
    truthy answer."""
    deadline = time.monotonic() + timeout_s
    while not (answer := await condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)
    return answer


def wait_until_sync(condition: Callable[[], T | None], what: str, timeout_s: float = 30.0) -> T:
    """`wait_until` for a test that runs outside an event loop (blocking sockets, threads); returns
    the condition's first truthy answer."""
    deadline = time.monotonic() + timeout_s
    while not (answer := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)
    return answer


def task_stacks(limit: int = 60) -> str:
    """Where each task of the running loop waits (its chain of awaits, innermost last), for the message
    of a wait that timed out: with the router and the client in one loop, this names the await that
    never ended."""
    lines = []
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name())[:limit]:
        chain = []
        awaited: Any = task.get_coro()
        while awaited is not None and len(chain) < 12:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None) or \
                getattr(awaited, "gi_frame", None)
            if frame is not None:
                name = frame.f_code.co_filename.rsplit("/", 1)[-1]
                chain.append(f"{frame.f_code.co_name}@{name}:{frame.f_lineno}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None) or \
                getattr(awaited, "gi_yieldfrom", None)
        lines.append(f"{task.get_name()}: {' > '.join(chain) or 'done'}")
    return "\n".join(lines)


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def connection_queues(port: int) -> str:
    """Every TCP socket of this host to or from `port` with the bytes the kernel holds for it: a receive
    queue that stays full names the end that stopped reading; a listener's is the connections not yet
    accepted. For the message of a request that got no answer."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, remote, state, queues = line.split()[1:5]
            local_port, remote_port = (int(end.rsplit(":", 1)[1], 16) for end in (local, remote))
            if port in (local_port, remote_port):
                send, receive = (int(queue, 16) for queue in queues.split(":"))
                rows.append(f"{local_port}->{remote_port} {_TCP_STATES.get(state, state)} "
                            f"send_q={send} recv_q={receive}")
    return f"sockets of port {port}: " + ("; ".join(sorted(rows)) or "none")


def unwatched_selector_fds() -> str:
    """File descriptors the running loop's selector lists but the kernel's epoll set does not: a socket
    closed behind the loop's back, whose number a new socket then reuses without ever being polled."""
    selector = getattr(asyncio.get_running_loop(), "_selector", None)
    if selector is None or not hasattr(selector, "fileno"):
        return "selector: not an epoll selector"
    try:
        with open(f"/proc/self/fdinfo/{selector.fileno()}") as info:
            polled = {int(line.split()[1]) for line in info if line.startswith("tfd:")}
    except OSError as exc:
        return f"selector: {exc}"
    unwatched = sorted(set(selector.get_map()) - polled)
    return f"selector fds not in epoll: {unwatched or 'none'}"
