"""The chaos bench's short run (bench/chaos.py): sim engines behind two routers under streaming load while
an engine and a llumlet are killed -9. Nothing may be lost or wrong, and once the load stops no
engine, llumlet or router may hold anything (blocks, requests, reservations, migrations, engine
staging) and no process may be left. The long runs and their figures are in docs/reliability.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def test_engine_and_llumlet_kills_under_load_lose_nothing_and_leak_nothing(tmp_path: Path) -> None:
    result_file = tmp_path / "chaos.json"
    bench = subprocess.Popen(
        [sys.executable, str(BENCH), "--seed", "3", "--duration", "6", "--faults", "engine,llumlet",
         "--instances", "2", "--concurrency", "4", "--min-tokens", "32", "--max-tokens", "160",
         "--migrate-every", "1", "--nice", "0", "--quiet", "--json", str(result_file),
         "--work-dir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        bench.terminate()  # SIGTERM: the bench stops its engines, llumlets and routers
        stdout, stderr = bench.communicate(timeout=60)
        raise AssertionError(f"the chaos bench did not finish in 240 s:\n{stdout}{stderr[-3000:]}") from None
    assert result_file.exists(), stdout + stderr
    result = json.loads(result_file.read_text())
    summary = stdout[-3000:]
    assert sorted(f["kind"] for f in result["faults"]) == ["engine", "llumlet"], summary
    for fault in result["faults"]:
        assert fault["error"] == "" and fault["recovered_s"] is not None, fault
    requests = result["requests"]
    assert requests["completed"] > 0, summary
    assert requests["lost"] == 0 and requests["failed-other"] == 0, summary
    assert requests["failed-clean"] == 0, summary  # no router was killed
    assert requests["sent"] == requests["completed"], summary
    assert result["leaks"] == {"total": 0, "processes_left": 0,
                               "staging": {"migrations": 0, "bytes": 0}}, summary
    assert bench.returncode == 0, summary
