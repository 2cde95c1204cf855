"""The prepared GPU run, on CPU: `bench/gpu_check.py --cpu` goes through every phase the GPU run does
(random model, two engines with llumlets, migrations over tcp and gloo with token equality, router
against direct, the latency profile) with CPU vLLM and the tiny model, and writes its reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llumnix.profile import load_profile

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)",
    ),
    pytest.mark.timeout(1800),
]


def test_the_cpu_dry_run_completes_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu_check.py"),
            "--cpu",
            "--out",
            str(out),
            "--model-cache",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=1700,
        cwd=tmp_path,
    )
    assert (out / "gpu_check.json").exists(), done.stderr[-5000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {p["name"]: p["status"] for p in report["phases"]} == dict.fromkeys(
        ("model", "engines", "migration", "router", "profile"), "ok"
    ), done.stderr[-5000:]
    assert done.returncode == 0
    migrations = report["migrations"]
    assert {(m["transport"], m["tokens"]) for m in migrations} == {
        (t, n) for t in ("tcp", "gloo") for n in report["plan"]["lengths"]
    }
    for m in migrations:
        assert m["outcome"] == "COMMITTED" and m["equal"], m
        assert m["downtime_ms"] > 0 and m["duration_ms"] >= m["downtime_ms"] and m["recompute_ms"] > 0
    assert (
        report["router"]["router"]["requests"]
        == report["router"]["direct"]["requests"]
        == report["plan"]["router_requests"]
    )
    profile = load_profile(str(out / "gpu_check_profile.json"))
    assert profile.prefill_time(512) > 0 and profile.decode_time(4, 512) > 0
    assert "NCCL" in report["skipped_channels"]["nccl"] or "CUDA" in report["skipped_channels"]["nccl"]
    assert "## Live migration against recompute" in (out / "gpu_check.md").read_text()
