"""`llumnix router --workers 2`: two router processes behind one port, each serving requests from
the llumlets' load streams; their metrics add up whichever worker a scrape reaches; SIGTERM stops
them all gracefully."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import psutil
import pytest
from service_auth import SERVICE_TOKEN

from llumnix.launch.child_process import ChildCommand, ChildProcess
from llumnix.launch.pair import EnginePair, free_port

pytestmark = pytest.mark.timeout(180)

MODEL = "sim"
REQUESTS = 24


def requests_total(exposition: str) -> float:
    return sum(float(m.group(1)) for m in
               re.finditer(r'^llumnix_router_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', exposition,
                           re.MULTILINE))


@pytest.mark.asyncio(loop_scope="module")
async def test_two_workers_share_the_port_and_their_metrics(
        sim_pairs: Callable[..., Awaitable[list[EnginePair]]], tmp_path: Path) -> None:
    pairs = await sim_pairs(2, "workers", engine_args=("--time-scale", "20"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = ChildProcess("router", tmp_path / "router.log", url + "/health", grace_s=30)
    try:
        await router.launch(ChildCommand((
            sys.executable, "-m", "llumnix.cli", "router", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--instances", ",".join(p.grpc_address for p in pairs), "--workers", "2"),
            SERVICE_TOKEN.environment()), timeout_s=60)
        assert router.pid is not None
        workers = [child for child in psutil.Process(router.pid).children()
                   if "spawn_main" in " ".join(child.cmdline())]  # not multiprocessing's resource tracker
        assert len(workers) == 2
        # Each worker has its own load streams: wait until both answer ready (the kernel spreads
        # connections over the workers, so both answer within a few tries).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            pids_ready: set[int] = set()
            deadline = asyncio.get_running_loop().time() + 60
            while len(pids_ready) < 2 and asyncio.get_running_loop().time() < deadline:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        pids_ready.add((await response.json())["pid"])
                await asyncio.sleep(0.01)
            assert pids_ready == {w.pid for w in workers}, "both workers serve, within 60 s"

            async def one(i: int) -> int:
                body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 20, "stream": i % 2 == 0}
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()
                    return response.status

            assert await asyncio.gather(*(one(i) for i in range(REQUESTS))) == [200] * REQUESTS
            for _ in range(4):  # whichever worker answers the scrape reports both workers' requests
                async with session.get(url + "/metrics") as response:
                    assert requests_total(await response.text()) == REQUESTS
        os.kill(router.pid, signal.SIGTERM)  # the supervisor alone: it passes the signal on
        deadline = asyncio.get_running_loop().time() + 60
        while router.returncode is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert router.returncode == 0, f"the router did not stop within 60 s: {router.log_tail()}"
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        await router.terminate()


def test_workers_below_one_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "llumnix.cli", "router", "--model", MODEL,
                           "--instances", "127.0.0.1:1", "--workers", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--workers must be at least 1" in done.stdout
