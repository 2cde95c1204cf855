"""bench/router_peer.py's parts that need no service: the CPU budget it prints, and `--split-cores`
placement (every thread of a process and of its children lands on the cores given, and the cores split in
two halves). The whole benchmark is run by hand (docs/router.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import psutil
import pytest
from script_module import load_bench

# A parent with a thread of its own that starts a child with a thread of its own; both print ready and
# then wait for stdin to close.
THREADED = """
import subprocess, sys, threading
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
child = None
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    child.stdout.readline()
print("ready", flush=True)
sys.stdin.read()
if child is not None:
    child.stdin.close()
    child.wait()
"""


@pytest.fixture(scope="module")
def router_peer() -> ModuleType:
    return load_bench("router_peer")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to split")
def test_the_halves_split_the_cores_this_process_may_use(router_peer: ModuleType) -> None:
    engine, hops = router_peer.core_halves()
    assert engine and hops and not engine & hops
    assert engine | hops == os.sched_getaffinity(0)
    assert max(engine) < min(hops)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to split")
def test_every_thread_of_a_process_and_its_children_is_pinned(router_peer: ModuleType) -> None:
    target = {min(os.sched_getaffinity(0))}
    parent = subprocess.Popen([sys.executable, "-c", THREADED, "parent", THREADED], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        processes = [psutil.Process(parent.pid), *psutil.Process(parent.pid).children(recursive=True)]
        assert len(processes) == 2
        assert all(len(process.threads()) >= 2 for process in processes)
        router_peer.pin(parent.pid, target)
        for process in processes:
            for thread in process.threads():
                assert os.sched_getaffinity(thread.id) == target
    finally:
        assert parent.stdin is not None
        parent.stdin.close()
        parent.wait(timeout=30)


def _row(path: str, concurrency: int, tokens_per_s: float) -> dict[str, object]:
    return {"path": path, "concurrency": concurrency, "output_throughput": tokens_per_s}


def test_the_cpu_budget_is_what_a_path_may_add_at_ninety_percent(router_peer: ModuleType) -> None:
    # 2 cores at 20,000 tokens/s: 100 µs of the machine per token; at 90% a path may spend 111.1 µs.
    rows = [_row("engine", 128, 20_000), _row("peer", 128, 18_000), _row("ours", 128, 10_000),
            _row("engine", 4, 4_000), _row("ours", 4, 4_000)]
    budget = router_peer.cpu_budget(rows, cores=2)
    assert [b["concurrency"] for b in budget] == [128, 4]
    saturated = budget[0]
    assert saturated["engine_us_per_token"] == pytest.approx(100.0)
    assert saturated["hops_may_add_us"] == pytest.approx(11.11, abs=0.01)
    # The peer at exactly 90% of the engine added exactly the budget; ours at half added the engine's own.
    assert saturated["added_us"] == {"peer": pytest.approx(11.11, abs=0.01), "ours": pytest.approx(100.0)}
    assert budget[1]["added_us"] == {"ours": pytest.approx(0.0)}
