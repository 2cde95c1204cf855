"""The checked-in gRPC/protobuf stubs are exactly what scripts/gen_proto.sh generates from proto/, and a
servicer method nobody implements answers UNIMPLEMENTED."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc

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


async def test_a_method_a_servicer_does_not_implement_answers_unimplemented() -> None:
    server = grpc.aio.server()
    llumlet_pb2_grpc.add_LlumletServicer_to_server(llumlet_pb2_grpc.LlumletServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = llumlet_pb2_grpc.LlumletStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Health(pb.HealthRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                async for _ in stub.WatchLoad(pb.WatchLoadRequest(), timeout=5):
                    pass
    finally:
        await server.stop(None)
    assert unary.value.code() == streaming.value.code() == grpc.StatusCode.UNIMPLEMENTED
