from pathlib import Path

import pytest
import torch

from llumnix.engine.handshake import (
    default_handshake_path,
    handshake_record,
    incompatibilities,
    migration_key,
    new_kv_secret,
    public_record,
    read_handshake,
    write_handshake,
)
from llumnix.engine.kv_blocks import KVBlockCopier


def record(block_size: int = 32, dtype=torch.float32, tp: int = 1, num_blocks: int = 8) -> dict:
    caches = {f"l{i}": torch.zeros((num_blocks, 2, block_size, 64), dtype=dtype) for i in range(2)}
    layout = KVBlockCopier(caches, num_blocks).layout
    return handshake_record(engine_id="e0", model="/models/tiny", block_size=block_size, layout=layout,
                            memory_layout="LBHNC", tensor_parallel_size=tp, pipeline_parallel_size=1)


def test_write_then_read_round_trip(tmp_path: Path):
    path = tmp_path / "sub" / "engine.sock.handshake.json"
    write_handshake(path, record())
    loaded = read_handshake(path)
    assert loaded["block_size"] == 32 and loaded["kv_dtype"] == "float32"
    assert loaded["kv_layout"]["page_shape"] == [2, 32, 64]
    assert loaded["kv_layout"]["bytes_per_block"] == 2 * 2 * 32 * 64 * 4
    assert list(path.parent.iterdir()) == [path]


def test_the_kv_secret_stays_in_the_owners_file_and_out_of_what_peers_see(tmp_path: Path):
    secret = new_kv_secret()
    path = tmp_path / "engine.sock.handshake.json"
    write_handshake(path, {**record(), "kv_secret": secret})
    assert path.stat().st_mode & 0o777 == 0o600
    loaded = read_handshake(path)
    assert loaded["kv_secret"] == secret and "kv_secret" not in public_record(loaded)
    assert public_record(loaded) == {k: v for k, v in loaded.items() if k != "kv_secret"}
    # One key per migration, which only the secret's holder can make.
    assert migration_key(secret, "m1") != migration_key(secret, "m2")
    assert migration_key(secret, "m1") != migration_key(new_kv_secret(), "m1")


def test_capacity_does_not_matter_but_layout_does():
    assert incompatibilities(record(num_blocks=8), record(num_blocks=64)) == []
    problems = incompatibilities(record(), record(block_size=64, dtype=torch.bfloat16, tp=2))
    fields = {p.split(":")[0] for p in problems}
    assert fields == {"kv_dtype", "block_size", "kv_layout", "tensor_parallel_size"}


def test_unknown_schema_is_refused(tmp_path: Path):
    path = tmp_path / "h.json"
    write_handshake(path, {**record(), "schema_version": 99})
    with pytest.raises(ValueError, match="schema 99"):
        read_handshake(path)


def test_default_path_only_for_ipc_sockets():
    assert default_handshake_path("ipc:///run/llumnix/e.sock") == Path("/run/llumnix/e.sock.handshake.json")
    assert default_handshake_path("tcp://127.0.0.1:5555") is None
    assert default_handshake_path(None) is None
