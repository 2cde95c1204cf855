"""The engine's startup handshake record: what a peer must match before KV blocks can move between two
engines (model, KV dtype, block size, KV layout and shapes, parallelism).

The connector's worker (tensor-parallel rank 0) writes it as JSON once the KV cache exists; the
llumlet reads it and sends it in the migration handshake, where `incompatibilities` decides.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kv_blocks imports torch; llumlets and sim engines read records without it
    from llumnix.engine.kv_blocks import KVLayout

HANDSHAKE_SCHEMA_VERSION = 1
HANDSHAKE_PATH_ENV = "LLUMNIX_HANDSHAKE_PATH"
"""Where the connector writes the record; default: next to an `ipc://` snapshot socket."""
KV_SECRET_FIELD = "kv_secret"

# Fields that must be equal on both ends of a migration.
COMPATIBILITY_FIELDS = (
    "model",
    "kv_dtype",
    "block_size",
    "kv_layout",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


def default_handshake_path(snapshot_addr: str | None) -> Path | None:
    """`<socket path>.handshake.json` for an `ipc://` address; None for other transports."""
    if snapshot_addr and snapshot_addr.startswith("ipc://"):
        return Path(snapshot_addr.removeprefix("ipc://") + ".handshake.json")
    return None


def handshake_record(
    *,
    engine_id: str,
    model: str,
    block_size: int,
    layout: KVLayout,
    memory_layout: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    kv_address: str | None = None,
    kv_channels: list[str] | None = None,
    kv_secret: str | None = None,
) -> dict[str, object]:
    """`kv_address`: where peers send migration stages to this engine; `kv_channels`: the KV channels
    it receives and sends on ("tcp", "gloo", "nccl"; negotiated per migration); `kv_secret`: what its
    KV receiver derives migration keys from (`migration_key`; never sent, see `public_record`). Not
    compared: every engine has its own."""
    # Per-layer shapes differ between tensor-parallel ranks only by the head split, which the
    # parallel sizes already pin down, so rank 0's layout stands for the engine.
    kv_layout = layout.to_record()
    kv_layout["memory_layout"] = memory_layout
    del kv_layout["num_blocks"]  # capacity, not compatibility
    return {
        "schema_version": HANDSHAKE_SCHEMA_VERSION,
        "engine_id": engine_id,
        "model": model,
        "kv_dtype": layout.dtype,
        "block_size": block_size,
        "num_blocks": layout.num_blocks,
        "kv_layout": kv_layout,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "pid": os.getpid(),
        "kv_address": kv_address,
        "kv_channels": kv_channels,
        KV_SECRET_FIELD: kv_secret,
    }


def new_kv_secret() -> str:
    """A KV receiver's secret, fresh per engine start (hex)."""
    return secrets.token_hex(32)


def migration_key(kv_secret: str, migration_id: str) -> bytes:
    """The key a migration's KV frames carry: only the destination's llumlet, which reads the engine's
    secret from the handshake record in their pod, can make it, and it hands it out only in its answer
    to an authenticated Propose. The receiver recomputes it per frame (no state to leak or expire)."""
    return hmac.new(bytes.fromhex(kv_secret), migration_id.encode(), hashlib.sha256).digest()


def public_record(record: dict[str, object]) -> dict[str, object]:
    """The record as a peer may see it (the Propose handshake): without the KV secret."""
    return {key: value for key, value in record.items() if key != KV_SECRET_FIELD}


def write_handshake(path: Path, record: dict[str, object]) -> None:
    """Atomic: a reader sees the previous file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    # Owner-only: it holds the KV secret (the llumlet beside the engine runs as the same user).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_handshake(path: Path) -> dict[str, object]:
    record = json.loads(path.read_text())
    version = record.get("schema_version")
    if version != HANDSHAKE_SCHEMA_VERSION:
        raise ValueError(f"{path}: handshake schema {version} is not {HANDSHAKE_SCHEMA_VERSION}")
    return record


def incompatibilities(mine: dict[str, object], peer: dict[str, object]) -> list[str]:
    """Human-readable reasons why KV blocks cannot move between the two engines (empty: compatible)."""
    return [
        f"{field}: {mine.get(field)!r} here, {peer.get(field)!r} on the peer"
        for field in COMPATIBILITY_FIELDS
        if mine.get(field) != peer.get(field)
    ]
