"""One instance as the llumlet contract sees it: an engine plus its llumlet, started together,
healthy together, stopped together. Used by tests, benchmarks and local mode.

    pair = EnginePair(PairConfig(instance_id="a", model_dir=model, work_dir=Path("/tmp/a")))
    await pair.start()      # engine healthy, then llumlet serving
    ...                     # pair.engine_url, pair.llumlet.http_url, pair.llumlet.grpc_address
    await pair.stop()       # llumlet (graceful), then engine
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from llumlet.engine_process import EngineLaunchConfig, EngineProcess
from llumlet.llumlet_process import LlumletProcess, LlumletProcessConfig

ENGINE_KINDS = ("vllm",)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class PairConfig:
    instance_id: str
    model_dir: Path
    work_dir: Path
    """Logs and the snapshot socket live here."""
    engine: str = "vllm"
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    engine_port: int = 0
    http_port: int = 0
    grpc_port: int = 0
    """0 picks a free port."""
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    block_size: int = 32
    kv_cache_gib: float = 1.0
    shutdown_grace_s: float = 30.0
    engine_start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"unknown engine kind {self.engine!r}; expected one of {ENGINE_KINDS}")


class EnginePair:
    def __init__(self, config: PairConfig) -> None:
        self.config = config
        host = config.host
        work = config.work_dir
        snapshot_addr = f"ipc://{work / 'snapshots.sock'}"
        self.engine = EngineProcess(EngineLaunchConfig(
            model=config.model_dir.resolve(),  # the engine runs in the work directory
            port=config.engine_port or free_port(host),
            host=host,
            served_model_name=config.served_model_name,
            block_size=config.block_size,
            kv_cache_gib=config.kv_cache_gib,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            dtype="float32",
            snapshot_addr=snapshot_addr,
            engine_id=config.instance_id,
            log_path=work / "engine.log",
        ))
        self.llumlet = LlumletProcess(LlumletProcessConfig(
            instance_id=config.instance_id,
            engine_url=self.engine.url,
            snapshot_addr=snapshot_addr,
            http_port=config.http_port or free_port(host),
            grpc_port=config.grpc_port or free_port(host),
            log_path=work / "llumlet.log",
            host=host,
            shutdown_grace_s=config.shutdown_grace_s,
        ))

    @property
    def engine_url(self) -> str:
        return self.engine.url

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    async def start(self) -> None:
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        # The llumlet starts with the engine: it serves /health (engine not ready) meanwhile and is
        # subscribed before the first snapshot.
        self.llumlet.start()
        try:
            await self.engine.start(timeout_s=self.config.engine_start_timeout_s)
            await self.llumlet.wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await self.llumlet.stop()
        await self.engine.stop()

    def kill_engine(self) -> None:
        """SIGKILL the engine's whole process group (a crash, for failure tests)."""
        if self.engine.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.engine.pid, signal.SIGKILL)
