import json
import os
import sys
import time
from pathlib import Path

import pytest

from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess, EngineStartError, build_command


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cpu_command_and_environment():
    config = EngineLaunchConfig(model="/models/tiny", port=8101, served_model_name="tiny", block_size=64,
                                kv_cache_gib=1.5, max_model_len=256, max_num_seqs=8,
                                snapshot_addr="ipc:///tmp/e.sock", engine_id="e0",
                                extra_args=("--max-num-batched-tokens", "512"), extra_env={"A": "b"})
    argv, env = build_command(config)
    assert argv[:3] == [sys.executable, "-m", "llumnix.engine.vllm_server"]
    assert flag(argv, "--model") == "/models/tiny" and flag(argv, "--port") == "8101"
    assert flag(argv, "--block-size") == "64" and flag(argv, "--max-model-len") == "256"
    assert flag(argv, "--max-num-seqs") == "8" and flag(argv, "--served-model-name") == "tiny"
    assert {"--enforce-eager", "--disable-hybrid-kv-cache-manager", "--enable-prefix-caching"} <= set(argv)
    assert json.loads(flag(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/e.sock.kv-events"}
    assert argv[-2:] == ["--max-num-batched-tokens", "512"]
    transfer = json.loads(flag(argv, "--kv-transfer-config"))
    assert transfer["kv_connector"] == "LlumnixConnector"
    assert transfer["kv_connector_module_path"] == "llumnix.engine.kv_connector"
    assert transfer["kv_connector_extra_config"] == {"snapshot_addr": "ipc:///tmp/e.sock", "engine_id": "e0"}
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # whole GiB, rounded up
    assert env["A"] == "b"


def test_gpu_command_sizes_cache_in_bytes_and_keeps_graphs():
    config = EngineLaunchConfig(model="m", port=1, device="gpu", block_size=16, kv_cache_gib=0.5)
    argv, env = build_command(config)
    assert flag(argv, "--kv-cache-memory-bytes") == str(2**29)
    assert "--enforce-eager" not in argv and "VLLM_TARGET_DEVICE" not in env


def test_without_snapshot_address_the_connector_is_off():
    argv, _ = build_command(EngineLaunchConfig(model="m", port=1))
    assert "--kv-transfer-config" not in argv


def test_cpu_block_size_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        EngineLaunchConfig(model="m", port=1, block_size=16)


async def test_engine_that_dies_at_start_reports_its_log(tmp_path: Path):
    # `python -m vllm.entrypoints...` with a python that cannot run it: exits at once.
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'fatal: no such engine' >&2\nexit 3\n")
    fake_python.chmod(0o755)
    engine = EngineProcess(EngineLaunchConfig(model="m", port=9, python=str(fake_python),
                                              log_path=tmp_path / "engine.log"))
    with pytest.raises(EngineStartError, match=r"(?s)exited with code 3.*fatal: no such engine"):
        await engine.start(timeout_s=30)


async def test_engine_that_never_gets_healthy_is_stopped(tmp_path: Path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho starting\nexec sleep 600\n")
    fake_python.chmod(0o755)
    engine = EngineProcess(EngineLaunchConfig(model="m", port=9, python=str(fake_python),
                                              log_path=tmp_path / "engine.log"))
    started = time.monotonic()
    with pytest.raises(EngineStartError, match=r"(?s)not healthy after 1 s.*starting"):
        await engine.start(timeout_s=1)
    assert engine.returncode is not None  # the launcher killed it
    assert time.monotonic() - started < 20


@pytest.mark.parametrize(("device", "nice", "expected"), [("cpu", None, 5), ("gpu", None, 0), ("cpu", 2, 2)])
async def test_engines_yield_the_cpu_to_the_token_path(tmp_path: Path, device: str, nice: int | None,
                                                      expected: int):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho \"niceness $(nice)\"\nexit 3\n")
    fake_python.chmod(0o755)
    engine = EngineProcess(EngineLaunchConfig(model="m", port=9, python=str(fake_python), device=device,
                                              nice=nice, log_path=tmp_path / "engine.log"))
    with pytest.raises(EngineStartError, match=f"niceness {os.nice(0) + expected}"):
        await engine.start(timeout_s=30)
