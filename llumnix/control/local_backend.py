"""Instances as local processes (local mode): each instance is an engine + llumlet pair
(`llumnix.launch.pair.EnginePair`): vLLM with the engine the operator's pods would run for the same spec
(`engine_launch_config`: runtime vllm on CUDA, vllm-cpu on CPU), or a sim engine (runtime sim). READY
once the pair is healthy; FAILED when its engine or llumlet exits or it cannot start."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from llumnix.control.backend import InstanceBackend, InstanceInfo, InstancePhase
from llumnix.launch.engine_process import CPU_BLOCK_SIZE, CPU_MAX_MODEL_LEN, engine_launch_config
from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.service_spec import ServiceSettings, SpecError
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumnix.control.local")

SIM_MAX_MODEL_LEN = 4096
START_CONCURRENCY = 4
"""Pairs starting at once: each start is a burst of CPU (imports); sixteen at once on two cores
take so long that llumlets miss their start-up deadline and are replaced, which adds more load."""
LOCAL_SHUTDOWN_GRACE_S = 5.0
"""A stopped instance was drained first; on Ctrl-C the router has already finished its requests."""


@dataclass
class _LocalInstance:
    pair: EnginePair
    created_at: float
    phase: InstancePhase = InstancePhase.STARTING
    message: str = ""
    starting: asyncio.Task[None] | None = field(default=None, repr=False)


def max_model_len(args: Sequence[str], default: int | None) -> int | None:
    """`--max-model-len` from the engine args (`--max-model-len N` or `=N`; the last one wins, as in
    argparse), else `default` (None: the model's, which the router then does not know); the router
    learns it."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--max-model-len" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
    if value is None:
        return default
    if not value.isdigit():
        raise SpecError(f"spec.engine.args: --max-model-len must be a number of tokens, got {value!r}")
    return int(value)


def pair_config(settings: ServiceSettings, instance_id: str, work_dir: Path, model_dir: Path | None
                ) -> PairConfig:
    """The engine + llumlet pair for one instance of `settings` (SpecError when it cannot run here)."""
    spec = settings.spec
    engine = spec.engine
    runtime = engine.runtime
    common = {"instance_id": instance_id, "work_dir": work_dir, "served_model_name": spec.model.name,
              "block_size": engine.block_size, "engine_args": engine.args,
              "llumlet_args": tuple(settings.llumlet_args), "shutdown_grace_s": LOCAL_SHUTDOWN_GRACE_S,
              # the manifest's start-up grace is how long a start may take, here as on a cluster
              "engine_start_timeout_s": spec.autoscaling.startup_grace_s}
    if runtime == "sim":
        return PairConfig(engine="sim", max_model_len=max_model_len(engine.args, SIM_MAX_MODEL_LEN),
                          **common)  # type: ignore[arg-type]
    path = Path(spec.model.path) if spec.model.path else model_dir
    if path is None:
        raise SpecError(f"spec.model.path is required for runtime {runtime} (local mode builds a tiny "
                        "model only for vllm-cpu without a path)")
    cpu = runtime == "vllm-cpu"
    if cpu and engine.block_size and engine.block_size % CPU_BLOCK_SIZE:
        raise SpecError(f"spec.engine.blockSize must be a multiple of {CPU_BLOCK_SIZE} for CPU vLLM, "
                        f"got {engine.block_size}")
    # The engine runs in its work directory: a relative model directory is resolved here (a hub id is
    # passed on as it is).
    model = path.resolve() if path.exists() else path
    launch = engine_launch_config(engine, model=model, served_model_name=spec.model.name, port=0)
    return PairConfig(engine="vllm", model_dir=path, vllm=launch,
                      max_model_len=max_model_len(engine.args, CPU_MAX_MODEL_LEN if cpu else None),
                      **common)  # type: ignore[arg-type]


class LocalProcessBackend(InstanceBackend):
    def __init__(self, settings: ServiceSettings, work_dir: Path, model_dir: Path | None = None, *,
                 token: ServiceToken | None = None) -> None:
        """`token`: the llumlets' credential (local mode generates one per run)."""
        self.settings = settings
        self.token = token
        self.work_dir = work_dir
        self.model_dir = model_dir
        self._instances: dict[str, _LocalInstance] = {}
        self._next_index = 0
        # GPU engines on one machine share its GPUs: vLLM sizes its KV cache from the device's free memory
        # before and after profiling, so another engine allocating meanwhile would be counted as its own.
        gpu = settings.spec.engine.runtime == "vllm"
        self._start_slots = asyncio.Semaphore(1 if gpu else START_CONCURRENCY)
        pair_config(settings, "check", work_dir, model_dir)  # a spec local mode cannot run fails here

    def pair(self, instance_id: str) -> EnginePair:
        """The processes behind an instance (tests kill them to simulate a crash)."""
        return self._instances[instance_id].pair

    async def list_instances(self) -> list[InstanceInfo]:
        infos = []
        for instance_id, instance in self._instances.items():
            if instance.phase is InstancePhase.READY:
                self._check_alive(instance)
            address = instance.pair.grpc_address if instance.phase is InstancePhase.READY else None
            infos.append(InstanceInfo(instance_id, instance.phase, address, instance.created_at,
                                      message=instance.message))
        return infos

    async def start_instance(self) -> InstanceInfo:
        instance_id = f"{self.settings.name}-{self._next_index}"
        self._next_index += 1
        config = replace(pair_config(self.settings, instance_id, self.work_dir / instance_id, self.model_dir),
                         service_token=self.token)
        instance = _LocalInstance(EnginePair(config), time.time())
        self._instances[instance_id] = instance
        instance.starting = asyncio.create_task(self._start(instance), name=f"start {instance_id}")
        return InstanceInfo(instance_id, instance.phase, None, instance.created_at)

    async def _start(self, instance: _LocalInstance) -> None:
        try:
            async with self._start_slots:
                instance.created_at = time.time()  # the start-up grace runs from here, not from the queue
                await instance.pair.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any start failure is the instance's state, not the caller's error
            instance.phase = InstancePhase.FAILED
            instance.message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            logger.warning("instance failed to start", extra={"instance_id": instance.pair.config.instance_id,
                                                              "reason": instance.message})
            return
        instance.phase = InstancePhase.READY

    @staticmethod
    def _check_alive(instance: _LocalInstance) -> None:
        llumlet = instance.pair.llumlet
        if not instance.pair.engine_running:
            instance.phase = InstancePhase.FAILED
            instance.message = f"engine exited (code {instance.pair.engine.returncode})"
        elif llumlet.pid is None or llumlet.returncode is not None:
            instance.phase = InstancePhase.FAILED
            instance.message = f"llumlet exited (code {llumlet.returncode})"

    async def stop_instance(self, instance_id: str) -> None:
        instance = self._instances.get(instance_id)
        if instance is None:
            return
        instance.phase = InstancePhase.TERMINATING
        if instance.starting is not None and not instance.starting.done():
            instance.starting.cancel()
            # EnginePair.start stops what it started when cancelled; wait() leaves our own
            # cancellation intact (awaiting the task under suppress(CancelledError) would swallow it).
            await asyncio.wait([instance.starting])
        await instance.pair.stop()
        self._instances.pop(instance_id, None)

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_instance(i) for i in list(self._instances)), return_exceptions=True)
