#!/usr/bin/env bash
# Regenerates the checked-in Python stubs (llumnix/v1/*_pb2*.py) from proto/. Run after editing a
# .proto file; tests/unit/test_proto_stubs.py fails when the stubs are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=${1:-.}
mkdir -p "$out"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/llumnix/v1/*.proto
