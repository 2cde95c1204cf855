"""The parts import only along the arrows of docs/architecture.md: import-linter checks the contracts in
pyproject.toml ([tool.importlinter]) over the installed packages."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_every_layering_contract_is_kept():
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert result.stdout.count(" KEPT") == len(contracts) >= 10


def test_a_forbidden_import_breaks_the_check(tmp_path: Path):
    # The router does import the load model: a contract forbidding it must be reported broken, so the
    # check above cannot pass by analysing nothing.
    config = tmp_path / "contracts.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["llumnix"]\n\n'
                      '[[tool.importlinter.contracts]]\nname = "router without the load model"\n'
                      'type = "forbidden"\nsource_modules = ["llumnix.router"]\n'
                      'forbidden_modules = ["llumnix.load"]\n')
    result = lint_imports("--config", str(config))
    assert result.returncode != 0
    assert "router without the load model BROKEN" in result.stdout
    assert "llumnix.router." in result.stdout and "-> llumnix.load" in result.stdout
