"""No test waits by sleeping: a test that sleeps and then asserts bets that the machine was fast enough
for the event to have happened, and on a loaded machine it fails (or, worse, passes without having
checked anything). Tests wait for the event they need with `tests/waiting.py` (a deadline that fails
loudly), an `asyncio.Event`, a task, or a stream's next message.

The scan reads every test module (an AST walk, so a sleep inside a string, such as a child process's
`python -c` program, is not one) and finds every use of `asyncio.sleep` or `time.sleep`, under any name
they were imported as. Each one outside tests/waiting.py must be in ALLOWED, keyed "path:function" with
the reason it is not a wait for an event. What may be there:
- a fake component's own behaviour (a fake engine pacing its tokens, a fake llumlet's heartbeat);
- a bounded window in which the test asserts that something does NOT happen (or how often it happens);
- the poll interval inside a wait loop that has its own deadline and fails loudly at it.
An entry that no longer matches a sleep fails too, so the list cannot outlive what it excuses."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
EXEMPT = {"tests/waiting.py"}
"""The waiting helpers themselves: their poll interval sits inside a deadline loop."""
SLEEPY_MODULES = {"asyncio", "time"}

_DEADLINE_POLL = "poll interval inside a wait loop with its own deadline that fails loudly"

ALLOWED: dict[str, str] = {
    # A fake component's own behaviour.
    "tests/unit/test_llumlet_engine_client.py:_endless_stream":
        "fake engine: paces the events of a stream that never ends by itself",
    "tests/unit/test_bench_gpu_check.py:test_a_batch_is_read_until_every_stream_decoded_together.completions":
        "fake engine: sleep(0) yields to the loop between tokens (no time involved)",
    "tests/unit/test_snapshot_channel.py:test_a_waiting_receive_wakes_on_the_snapshot_not_its_timeout":
        "sleep(0) yields once so the receive parks before the publish (no time involved)",
    "tests/unit/test_migration_destination.py:_slow_engine.completions":
        "fake engine: paces its tokens after the first one (the first waits for an event the test sets)",
    "tests/integration/test_router_failures.py:MovingLlumlet.WatchLoad":
        "fake llumlet: paces its load heartbeats",
    "tests/integration/test_migration_sim.py:LostMoveLlumlet.WatchLoad":
        "fake llumlet: paces its load heartbeats",
    # A bounded window measuring how often something happens.
    "tests/integration/test_llumlet_contract.py:test_watch_load_pushes_changes_at_a_bounded_rate":
        "bounded windows (1.5 s idle, 0.3 s after the request) counting WatchLoad pushes to assert their "
        "rate cap: at most a heartbeat a second while idle, at most one push per 50 ms while busy",
    # Steps of a deterministic harness (the loop's own tasks run between two passes).
    "tests/unit/test_control_loop_decisions.py:"
    "test_migration_pairs_an_overloaded_source_with_the_freest_one_in_flight_per_source":
        "sleep(0) yields once so the migration task the pass started runs up to its held call (no time "
        "involved; the fake llumlet's `hold` event keeps it in flight)",
    "tests/integration/test_control_loop.py:"
    "test_autoscaling_goes_up_under_load_and_back_down_with_every_request_completed.watch":
        "a sampler recording the peak ready count every 0.2 s while the bench runs, not a wait",
    # The poll interval of a wait with a deadline (each fails loudly with what it last saw).
    "tests/integration/test_control_loop.py:wait_for": _DEADLINE_POLL,
    "tests/integration/test_llumlet_contract.py:_wait_for_load": _DEADLINE_POLL,
    "tests/integration/test_llumlet_contract.py:_wait_for": _DEADLINE_POLL,
    "tests/integration/test_migration_sim.py:Llumlet.wait_load": _DEADLINE_POLL,
    "tests/integration/test_migration_vllm.py:_migrate":
        "retry interval of MigrateOut while either end is busy, until its deadline",
    "tests/integration/test_migration_vllm.py:_wait_idle": _DEADLINE_POLL,
    "tests/integration/test_router_workers.py:test_two_workers_share_the_port_and_their_metrics":
        _DEADLINE_POLL + " (both workers answering /health; the router exiting after SIGTERM)",
    "tests/integration/test_service_vllm.py:serving_instance": _DEADLINE_POLL,
    "tests/integration/test_service_vllm.py:"
    "test_an_engine_killed_mid_stream_is_replayed_to_the_same_text_and_a_replacement_starts":
        _DEADLINE_POLL + " (the killed instance replaced)",
    "tests/integration/test_sim_engine.py:SimEngine.wait_healthy": _DEADLINE_POLL,
}


def _test_files() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py")
                  if str(path.relative_to(ROOT)) not in EXEMPT and ".venv" not in path.parts)


class _SleepFinder(ast.NodeVisitor):
    """Every use of asyncio.sleep / time.sleep, with the function (dotted through classes and nested
    functions) it is in."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        """Names bound to the asyncio or time module (`import time`, `import asyncio as aio`)."""
        self.functions: set[str] = set()
        """Names bound to their sleep (`from time import sleep`, `... import sleep as pause`)."""
        self.scope: list[str] = []
        self.found: list[tuple[str, int]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in SLEEPY_MODULES:
                self.modules.add(alias.asname or alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in SLEEPY_MODULES and node.level == 0:
            self.functions.update(alias.asname or alias.name for alias in node.names if alias.name == "sleep")

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "sleep" and isinstance(node.value, ast.Name) and node.value.id in self.modules:
            self.found.append((".".join(self.scope) or "<module>", node.lineno))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.functions and isinstance(node.ctx, ast.Load):
            self.found.append((".".join(self.scope) or "<module>", node.lineno))


def _sleeps(source: str, relative: str) -> list[tuple[str, int]]:
    """("path:function", line) for each sleep in the source. Imports are collected first, so one
    placed below its use (or inside a function) still counts."""
    tree = ast.parse(source, relative)
    finder = _SleepFinder()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            finder.visit(node)
    finder.visit(tree)
    return [(f"{relative}:{function}", line) for function, line in finder.found]


def _all_sleeps() -> list[tuple[str, int]]:
    return [found for path in _test_files()
            for found in _sleeps(path.read_text(), str(path.relative_to(ROOT)))]


def test_the_scan_reads_the_tests() -> None:
    files = {str(path.relative_to(ROOT)) for path in _test_files()}
    assert {"tests/unit/test_engine_monitor.py", "tests/integration/test_migration_sim.py",
            "tests/conftest.py", "tests/unit/test_no_sleep_as_event.py"} <= files
    assert "tests/waiting.py" not in files


def test_no_test_sleeps_instead_of_waiting_for_its_event() -> None:
    unexcused = [f"{where} (line {line})" for where, line in _all_sleeps() if where not in ALLOWED]
    assert unexcused == [], ("wait for the event (tests/waiting.py) instead of sleeping, or add the "
                             "function to ALLOWED with the reason it is no wait")


def test_every_allowed_entry_still_excuses_a_sleep() -> None:
    used = {where for where, _ in _all_sleeps()}
    assert sorted(set(ALLOWED) - used) == []


def test_every_allowed_entry_gives_a_reason() -> None:
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_scan_would_see_a_sleep() -> None:
    sample = (
        "import asyncio\nimport time as clock\nfrom asyncio import sleep as pause\n"
        "async def test_a():\n    await asyncio.sleep(0.1)\n"
        "class Fake:\n    def step(self):\n        clock.sleep(1)\n"
        "        def inner():\n            return pause(0)\n"
        "later = map(clock.sleep, [1])\n"
        "def test_b():\n    from time import sleep\n    sleep(2)\n"
        "def test_c():\n    return 'time.sleep(600)', other.sleep(1)\n"
    )
    assert _sleeps(sample, "tests/x.py") == [
        ("tests/x.py:test_a", 5), ("tests/x.py:Fake.step", 8), ("tests/x.py:Fake.step.inner", 10),
        ("tests/x.py:<module>", 11), ("tests/x.py:test_b", 14)]
