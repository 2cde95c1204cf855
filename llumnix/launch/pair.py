"""One instance as the llumlet contract sees it: an engine plus its llumlet, started together,
healthy together, stopped together. Used by tests, benchmarks and local mode. The engine is a CPU
vLLM with the llumnix connector (`engine="vllm"`, needs `model_dir`) or the sim engine
(`engine="sim"`, no model).

    pair = EnginePair(PairConfig(instance_id="a", work_dir=Path("/tmp/a"), engine="sim"))
    await pair.start()      # engine healthy, then llumlet serving
    ...                     # pair.engine_url, pair.llumlet.http_url, pair.llumlet.grpc_address
    pair.kill_engine()      # a crash (failure tests)
    await pair.stop()       # llumlet (graceful), then engine
"""

from __future__ import annotations

import dataclasses
import random
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess
from llumnix.launch.llumlet_process import LlumletProcess, LlumletProcessConfig
from llumnix.launch.sim_engine_process import SimEngineProcess
from llumnix.service_token import ServiceToken

ENGINE_KINDS = ("vllm", "sim")


PICKED_PORTS = range(20000, 32768)
"""Where `free_port` looks: above the usual fixed service ports, below Linux's ephemeral range (32768 on),
from which the kernel takes every outgoing connection's local port."""
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a child to bind later. Not from the ephemeral range (a
    busy process's outgoing connections took such a port between the check and the child's bind,
    which then failed) and never one this process handed out before (pairs started together pick
    all their ports before any child binds one)."""
    for _ in range(len(PICKED_PORTS)):
        port = random.choice(PICKED_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PICKED_PORTS.start}-{PICKED_PORTS.stop - 1} on {host}")


class Engine(Protocol):
    """What a pair needs of an engine process (EngineProcess, SimEngineProcess: both ChildProcesses)."""

    url: str

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def log_tail(self, lines: int = ...) -> str: ...

    def signal(self, sig: int) -> None: ...

    async def start(self, timeout_s: float) -> None: ...

    async def stop(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class PairConfig:
    instance_id: str
    work_dir: Path
    """Logs and the snapshot socket live here."""
    engine: str = "vllm"
    model_dir: Path | None = None
    """The model vLLM serves (required for vllm; the sim engine has none)."""
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    engine_port: int = 0
    http_port: int = 0
    grpc_port: int = 0
    """0 picks a free port."""
    max_model_len: int | None = 1024
    """None: the model's own (a GPU engine from a spec, `vllm`)."""
    max_num_seqs: int | None = None
    block_size: int | None = 32
    """None: the engine's own (the sim engine: its profile's)."""
    kv_cache_gib: float = 1.0
    """vLLM's KV cache size; the sim engine's pool is `num_blocks`."""
    vllm: EngineLaunchConfig | None = None
    """The vLLM engine as `engine_launch_config` builds it from a spec (local mode), in place of the CPU
    engine the fields above describe (tests, benchmarks); its port, socket, id and log are the pair's."""
    num_blocks: int | None = None
    """Sim engine only: KV blocks (None: the profile's capacity)."""
    engine_args: tuple[str, ...] = ()
    """More engine flags, e.g. ("--time-scale", "10") for the sim engine."""
    llumlet_args: tuple[str, ...] = ()
    service_token: ServiceToken | None = None
    """The llumlet's credential (None: it serves anyone, for tests and benchmarks that dial it bare)."""
    shutdown_grace_s: float = 30.0
    engine_start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"unknown engine kind {self.engine!r}; expected one of {ENGINE_KINDS}")
        if self.engine == "vllm" and self.model_dir is None and self.vllm is None:
            raise ValueError("a vllm pair needs model_dir or vllm")
        if self.engine == "vllm" and self.num_blocks is not None:
            raise ValueError("num_blocks is for the sim engine; size vLLM's cache with kv_cache_gib")


def _make_engine(config: PairConfig, snapshot_addr: str) -> Engine:
    port = config.engine_port or free_port(config.host)
    log_path = config.work_dir / "engine.log"
    if config.engine == "sim":
        flags = ["--model", config.served_model_name]
        for flag, value in (("--max-model-len", config.max_model_len), ("--block-size", config.block_size),
                            ("--max-num-seqs", config.max_num_seqs), ("--num-blocks", config.num_blocks)):
            if value is not None:
                flags += [flag, str(value)]
        return SimEngineProcess(config.instance_id, port, log_path, snapshot_addr,
                                (*flags, *config.engine_args), config.host)
    launch = config.vllm
    if launch is None:
        assert config.model_dir is not None
        launch = EngineLaunchConfig(
            model=config.model_dir.resolve(),  # the engine runs in the work directory
            port=port,
            served_model_name=config.served_model_name,
            block_size=config.block_size,
            kv_cache_gib=config.kv_cache_gib,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            dtype="float32",
            extra_args=config.engine_args,
        )
    return EngineProcess(dataclasses.replace(launch, port=port, host=config.host, snapshot_addr=snapshot_addr,
                                             engine_id=config.instance_id, log_path=log_path))


class EnginePair:
    def __init__(self, config: PairConfig) -> None:
        self.config = config
        host = config.host
        work = config.work_dir
        snapshot_addr = f"ipc://{work / 'snapshots.sock'}"
        self.engine = _make_engine(config, snapshot_addr)
        self.llumlet = LlumletProcess(LlumletProcessConfig(
            instance_id=config.instance_id,
            engine_url=self.engine.url,
            snapshot_addr=snapshot_addr,
            http_port=config.http_port or free_port(host),
            grpc_port=config.grpc_port or free_port(host),
            log_path=work / "llumlet.log",
            host=host,
            shutdown_grace_s=config.shutdown_grace_s,
            extra_args=config.llumlet_args,
            service_token=config.service_token,
        ))

    @property
    def engine_url(self) -> str:
        return self.engine.url

    @property
    def grpc_address(self) -> str:
        return self.llumlet.grpc_address

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    @property
    def engine_running(self) -> bool:
        return self.engine.pid is not None and self.engine.returncode is None

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
        self.engine.signal(signal.SIGKILL)
