"""The engine an LLMService's `spec.engine` asks for: GPU engines follow vLLM's own defaults (KV cache by
memory utilisation, max-model-len from the model, block size and dtype chosen by the engine), CPU engines
get fixed ones, and local mode and the operator's pods build the same engine from the same spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llumnix.control.local_backend import pair_config
from llumnix.launch.engine_process import EngineLaunchConfig, build_command
from llumnix.launch.pair import EnginePair
from llumnix.service_spec import ServiceSettings, parse_service
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.engine_pod import engine_command, engine_pod

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy/examples"
PLACEMENT_FLAGS = ("--model", "--host", "--port", "--kv-transfer-config", "--kv-events-config")
"""Where one engine runs and which socket it publishes on: the pod's and the local process's differ."""


def service(engine: dict, model_path: str = "/models/llama") -> ServiceSettings:
    return parse_service({"apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService",
                          "metadata": {"name": "s"},
                          "spec": {"model": {"name": "llama", "path": model_path}, "engine": engine}})


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` and bare `--flag` of an engine argv, the placement flags left out."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg in PLACEMENT_FLAGS:
            continue
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[arg] = value
    return out


def test_a_gpu_engine_takes_vllms_defaults_and_sizes_its_cache_by_memory_utilisation() -> None:
    argv, env = build_command(EngineLaunchConfig(model="/m", port=1, device="gpu"))
    got = flags(argv)
    assert got["--gpu-memory-utilization"] == "0.9"
    for engine_default in ("--max-model-len", "--block-size", "--dtype", "--kv-cache-memory-bytes",
                           "--enforce-eager"):
        assert engine_default not in got
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_TARGET_DEVICE" not in env
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_set_values_reach_a_gpu_engine() -> None:
    argv, _ = build_command(EngineLaunchConfig(model="/m", port=1, device="gpu", block_size=16,
                                               max_model_len=8192, dtype="bfloat16",
                                               gpu_memory_utilization=0.4))
    got = flags(argv)
    assert (got["--block-size"], got["--max-model-len"], got["--dtype"], got["--gpu-memory-utilization"]) == (
        "16", "8192", "bfloat16", "0.4")


def test_a_cpu_engine_gets_the_cpu_defaults() -> None:
    argv, env = build_command(EngineLaunchConfig(model="/m", port=1))
    got = flags(argv)
    assert (got["--block-size"], got["--max-model-len"], got["--dtype"]) == ("32", "1024", "float32")
    assert "--gpu-memory-utilization" not in got and "--enforce-eager" in got
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # One forward thread, not pinned: engines sharing cores must not spin at each other's barriers.
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "nobind")


@pytest.mark.parametrize(("cpu", "threads"), [(None, "1"), ("4", "4"), ("2.5", "2"), ("2500m", "2"),
                                              ("500m", "1"), ("1.9", "1")])
def test_a_cpu_engine_computes_on_the_whole_cpus_its_spec_asks_for(cpu: str | None, threads: str,
                                                                  tmp_path: Path) -> None:
    engine = {"runtime": "vllm-cpu", **({"resources": {"cpu": cpu}} if cpu else {})}
    _, pod_env = engine_command(service(engine).spec)
    pair = EnginePair(pair_config(service(engine), "s-0", tmp_path, None))
    _, local_env = build_command(pair.engine.config)  # type: ignore[attr-defined]
    assert pod_env["OMP_NUM_THREADS"] == local_env["OMP_NUM_THREADS"] == threads


def test_cpu_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineLaunchConfig(model="/m", port=1, cpu_threads=0)


def test_memory_utilisation_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineLaunchConfig(model="/m", port=1, device="gpu", gpu_memory_utilization=1.5)


@pytest.mark.parametrize("engine", [
    {"runtime": "vllm"},
    {"runtime": "vllm", "gpuMemoryUtilization": 0.4, "blockSize": 16, "args": ["--max-model-len=8192"],
     "resources": {"gpus": 2, "tensorParallelSize": 2}},
    {"runtime": "vllm-cpu"},
    {"runtime": "vllm-cpu", "blockSize": 64, "args": ["--max-model-len", "2048"]},
], ids=["gpu-defaults", "gpu-set", "cpu-defaults", "cpu-set"])
def test_local_mode_and_pods_build_the_same_engine(engine: dict, tmp_path: Path) -> None:
    settings = service(engine)
    pod_argv, pod_env = engine_command(settings.spec)
    pair = EnginePair(pair_config(settings, "s-0", tmp_path / "s-0", None))
    local_argv, local_env = build_command(pair.engine.config)  # type: ignore[attr-defined]
    assert flags(pod_argv) == flags(local_argv)
    assert {k: v for k, v in pod_env.items() if k != "LLUMNIX_KV_HOST"} == local_env
    assert pod_argv[pod_argv.index("--model") + 1] == local_argv[local_argv.index("--model") + 1] \
        == "/models/llama"


def test_a_gpu_spec_leaves_the_engine_its_defaults_and_passes_what_is_set(tmp_path: Path) -> None:
    defaults = flags(engine_command(service({"runtime": "vllm"}).spec)[0])
    assert defaults["--gpu-memory-utilization"] == "0.9"
    assert not {"--max-model-len", "--block-size", "--dtype"} & defaults.keys()
    shared = flags(engine_command(service({"runtime": "vllm", "gpuMemoryUtilization": 0.4, "blockSize": 16,
                                           "args": ["--max-model-len=8192"]}).spec)[0])
    assert (shared["--gpu-memory-utilization"], shared["--block-size"]) == ("0.4", "16")
    assert "--max-model-len=8192" in shared
    # The router learns the set limit; without one the engines take the model's, which it does not know.
    assert pair_config(service({"runtime": "vllm"}), "s-0", tmp_path, None).max_model_len is None
    assert pair_config(service({"runtime": "vllm", "args": ["--max-model-len=8192"]}), "s-0", tmp_path,
                       None).max_model_len == 8192
    assert pair_config(service({"runtime": "vllm-cpu"}), "s-0", tmp_path, None).max_model_len == 1024


def test_a_sim_engine_takes_its_profiles_block_size_unless_set() -> None:
    sim = service({"runtime": "sim"}).spec
    assert "--block-size" not in engine_command(sim)[0]
    argv = engine_command(service({"runtime": "sim", "blockSize": 32}).spec)[0]
    assert argv[argv.index("--block-size") + 1] == "32"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_service(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    parse_service(next(d for d in documents if d.get("kind") == "LLMService"))


def test_the_gpu_example_builds_a_valid_gpu_engine_pod() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                              reason="kubernetes-validate is not installed")
    settings = parse_service(yaml.safe_load((EXAMPLES / "gpu-cluster.yaml").read_text()))
    pod = engine_pod(settings, BuildConfig())
    kubernetes_validate.validate(pod, "1.33", strict=True)
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["image"] == BuildConfig().vllm_image  # the example names no image: the operator's default
    assert "--gpu-memory-utilization" in engine["args"] and "--enforce-eager" not in engine["args"]
