"""deploy/kind/run.sh skips cleanly where docker and kind are missing (its full run needs them)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy/kind/run.sh"


def test_kind_script_skips_without_docker_and_kind(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    # An empty PATH: none of docker, kind, kubectl, helm can be found.
    result = subprocess.run([bash, str(SCRIPT)], env={"PATH": str(tmp_path)}, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("skipped: docker/kind not found")
    assert "docker" in result.stdout and "kind" in result.stdout
