#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests need.
# Idempotent: re-running with unchanged inputs does nothing (stamp = hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

inputs_hash=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp="$VENV/.llumnix-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs_hash" ]; then
  exit 0
fi

echo "[setup] creating $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
echo "[setup] installing llumnix-k8s (core + dev tools)"
"${PIP[@]}" install -e '.[dev]'
echo "$inputs_hash" > "$stamp"
echo "[setup] done"
