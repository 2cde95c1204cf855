#!/usr/bin/env bash
# Regenerates the checked-in Python stubs (llumnix/v1/*_pb2*.py) from proto/. Run after editing a
# .proto file; tests/unit/test_proto_stubs.py fails when the stubs are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=${1:-.}
mkdir -p "$out"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/llumnix/v1/*.proto
# Our gRPC servers are all grpc.aio: make the servicer base classes' default methods coroutines that
# answer UNIMPLEMENTED with `context.abort`, instead of protoc's set_code + raise NotImplementedError
# (which reads as unfinished code and is reported as UNKNOWN by an aio server).
"$PY" - "$out"/llumnix/v1/*_pb2_grpc.py <<'PYEOF'
import re
import sys

DEFAULT_BODY = re.compile(
    r"    def (\w+)\(self, (request|request_iterator), context\):\n"
    r"((?:        .*\n)*?)"
    r"        context\.set_code\(grpc\.StatusCode\.UNIMPLEMENTED\)\n"
    r"        context\.set_details\('Method not implemented!'\)\n"
    r"        raise NotImplementedError\('Method not implemented!'\)\n")
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = DEFAULT_BODY.sub(
        r"    async def \1(self, \2, context):\n\3"
        r"        await context.abort(grpc.StatusCode.UNIMPLEMENTED, 'Method not implemented!')\n", text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
PYEOF
