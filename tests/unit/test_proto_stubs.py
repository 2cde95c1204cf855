"""The checked-in gRPC/protobuf stubs are exactly what scripts/gen_proto.sh generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_stubs_match_regenerated(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PY": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "llumnix" / "v1").glob("*_pb2*"))
    assert generated, "gen_proto.sh produced no stubs"
    checked_in = sorted(p.relative_to(ROOT) for p in (ROOT / "llumnix" / "v1").glob("*_pb2*"))
    assert generated == checked_in
    for rel in generated:
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), (
            f"{rel} is stale: run scripts/gen_proto.sh")
