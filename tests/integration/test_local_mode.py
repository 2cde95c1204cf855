"""`llumnix up` as a user runs it (a subprocess, sim engines): it starts, prints the endpoint, serves
the `openai` SDK and `llumnix admin`, and on SIGTERM stops everything it started; `--demo` runs a
workload with a migration, prints the summary and stops by itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from llumnix.control.status import FREENESS_MEANING

pytestmark = [pytest.mark.timeout(300)]

MODEL = "sim"
ROOT = Path(__file__).resolve().parents[2]


def write_manifest(path: Path, instances: int = 2) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService", "metadata": {"name": "local"},
        "spec": {"model": {"name": MODEL}, "engine": {"runtime": "sim", "args": ["--time-scale", "2"]},
                 "instances": {"min": instances, "max": instances},
                 "migration": {"enabled": True, "intervalMs": 100}}}), encoding="utf-8")
    return path


def up(manifest: Path, work_dir: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llumnix.cli", "up", "-f", str(manifest), "--port", "0", "--admin-port", "0",
         "--work-dir", str(work_dir), "--status-interval", "0.5", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def read_until(process: subprocess.Popen[str], pattern: str, timeout_s: float) -> tuple[re.Match[str], str]:
    assert process.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match, "".join(seen)
    raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(seen)}")


def processes_using(path: Path) -> list[int]:
    """Processes whose command line names `path` (engines and llumlets live under the work dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


@pytest.fixture
def work_dir(tmp_path: Path) -> Iterator[Path]:
    work = tmp_path / "work"
    yield work
    for pid in processes_using(work):  # never leave processes behind, even when the test failed
        os.kill(pid, signal.SIGKILL)


def test_up_serves_the_openai_sdk_and_admin_then_stops_cleanly_on_sigterm(tmp_path: Path, work_dir: Path
                                                                          ) -> None:
    process = up(write_manifest(tmp_path / "service.yaml"), work_dir)
    try:
        match, _ = read_until(process, r"serving 'sim' at (http://\S+)/v1 .*admin API at (http://\S+) ", 180)
        url, admin_url = match.group(1), match.group(2)
        children = [pid for pid in processes_using(work_dir) if pid != process.pid]
        assert len(children) == 4  # two engines, two llumlets

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        completion = client.completions.create(model=MODEL, prompt="hello there", max_tokens=8)
        assert completion.usage.completion_tokens == 8 and completion.choices[0].text
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        admin = subprocess.run([sys.executable, "-m", "llumnix.cli", "admin", "--url", admin_url, "status"],
                               capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert admin.returncode == 0, admin.stderr
        assert "local-0" in admin.stdout and "local-1" in admin.stdout
        assert "2 ready / 2 desired" in admin.stdout

        read_until(process, r"2/2 ready \| headroom", 30)  # the live status line
        process.send_signal(signal.SIGTERM)
        read_until(process, r"^stopped", 60)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert processes_using(work_dir) == []


def test_up_demo_runs_a_workload_with_a_migration_and_stops(tmp_path: Path, work_dir: Path) -> None:
    process = up(write_manifest(tmp_path / "service.yaml"), work_dir, "--demo", "--workload", "16",
                 "--rate", "8")
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "finished 16/16" in output
    assert re.search(r"migrations: .*committed \d+", output), output
    # each instance's freeness in words (idle, draining, decode steps), never a bare number; its meaning
    in_words = r"(idle|draining|\d+ decode steps)"
    assert re.search(rf"freeness per instance: local-0 {in_words}, local-1 {in_words}\n", output), output
    assert FREENESS_MEANING in output
    assert processes_using(work_dir) == []
