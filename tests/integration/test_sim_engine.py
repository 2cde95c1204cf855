"""`llumnix sim-engine` as a real process: vLLM's HTTP API and answers (checked against responses
captured from vLLM 0.32 in vllm_0_32_responses.json), deterministic tokens, per-step snapshots with
exact block accounting, queueing and preemption, /metrics, aborts on disconnect, many engines."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from llumlet.engine_metrics import parse_engine_metrics
from llumnix.engine.snapshots import SnapshotSubscriber
from llumnix.launch.pair import free_port
from llumnix.v1.engine_pb2 import EngineSnapshot

pytestmark = pytest.mark.timeout(120)

VLLM_RESPONSES = json.loads((Path(__file__).parent / "vllm_0_32_responses.json").read_text())
"""Captured from `vllm serve` 0.32 (CPU) with a tiny model served as "tiny", --max-model-len 512."""


class SimEngine:
    """One `python -m llumnix.sim_engine` process."""

    def __init__(self, work: Path, name: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.snapshot_addr = f"ipc://{work}/{name}.sock"
        self.log = work / f"{name}.log"
        self.args = [
            sys.executable,
            "-m",
            "llumnix.sim_engine",
            "--port",
            str(self.port),
            "--snapshot-addr",
            self.snapshot_addr,
            "--engine-id",
            name,
            *flags,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.log.read_text()
            try:
                async with session.get(self.url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"sim engine not healthy after {timeout_s} s: {self.log.read_text()}")

    def rss_mib(self) -> float:
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return kib / 1024

    def stop(self) -> int:
        assert self.process is not None
        self.process.terminate()
        return self.process.wait(timeout=10)


async def _started(work: Path, name: str, *flags: str) -> SimEngine:
    engine = SimEngine(work, name, *flags)
    engine.launch()
    async with aiohttp.ClientSession() as session:
        await engine.wait_healthy(session)
    return engine


# The captured vLLM ran with these limits; a fast clock keeps every test short.
TINY_LIMITS = ("--model", "tiny", "--max-model-len", "512", "--block-size", "32", "--num-blocks", "64")
TINY_FLAGS = (*TINY_LIMITS, "--time-scale", "20")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SimEngine]:
    started = await _started(tmp_path_factory.mktemp("sim-engine"), "tiny", *TINY_FLAGS)
    yield started
    assert started.stop() == 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real_time_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SimEngine]:
    """The tiny engine at the profile's own speed (a decode step of about 26 ms, not 1.3 ms): a request
    that runs while a test acts on it lasts seconds, however slowly the test acts."""
    started = await _started(tmp_path_factory.mktemp("sim-engine-real-time"), "tiny-real-time", *TINY_LIMITS,
                             "--time-scale", "1")
    yield started
    assert started.stop() == 0


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    path: str = "/v1/completions",
    raw: bytes | None = None,
) -> tuple[int, Any]:
    """Status and JSON body, or the list of stream events for a stream."""
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as response:
        text = await response.text()
    if text.startswith("data:"):
        lines = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return response.status, [json.loads(line) for line in lines[:-1]]
    return response.status, json.loads(text)


def _token_ids(response: Any) -> list[int]:
    if isinstance(response, list):
        return [t for event in response for choice in event["choices"] for t in choice.get("token_ids") or ()]
    return response["choices"][0]["token_ids"]


def _text(response: Any, chat: bool) -> str:
    if isinstance(response, list):
        key = "delta" if chat else None
        return "".join(
            (c[key].get("content") or "") if key else c["text"]
            for event in response
            for c in event["choices"]
        )
    choice = response["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def _shape(value: Any) -> Any:
    """Keys (recursively) and value kinds of a JSON value: what a client parses."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value and isinstance(value[0], (dict, list)) else "list"
    return "null" if value is None else type(value).__name__


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", sorted(VLLM_RESPONSES))
async def test_answers_have_vllms_shape_status_and_errors(engine: SimEngine, case: str) -> None:
    captured = VLLM_RESPONSES[case]
    raw = captured["body"].encode() if isinstance(captured["body"], str) else None
    async with aiohttp.ClientSession() as session:
        status, response = await _post(session, engine.url, captured["body"], captured["path"], raw)
    assert status == captured["status"], response
    expected = captured["response"]
    if "error" in expected:
        got, want = response["error"], expected["error"]
        assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"])
        if want["type"] != "Bad Request":  # pydantic's wording is only approximated
            assert got["message"] == want["message"]
    elif isinstance(expected, list):
        assert [_shape(e) for e in response[:2]] == [_shape(e) for e in expected[:2]]
        assert [_shape(e) for e in response[-2:]] == [_shape(e) for e in expected[-2:]]
    else:
        assert _shape(response) == _shape(expected)


@pytest.mark.asyncio(loop_scope="module")
async def test_streamed_and_whole_answers_carry_the_same_deterministic_tokens(engine: SimEngine) -> None:
    completion = {
        "model": "tiny",
        "prompt": "The quick brown fox",
        "max_tokens": 40,
        "return_token_ids": True,
    }
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 40,
        "return_token_ids": True,
    }
    async with aiohttp.ClientSession() as session:
        for body, path, is_chat in (
            (completion, "/v1/completions", False),
            (chat, "/v1/chat/completions", True),
        ):
            answers = await asyncio.gather(
                *(
                    _post(session, engine.url, {**body, "stream": stream}, path)
                    for stream in (False, True, False)
                )
            )
            whole, streamed, again = (response for _, response in answers)
            assert len(_token_ids(whole)) == 40
            assert _token_ids(streamed) == _token_ids(whole) == _token_ids(again)
            assert _text(streamed, is_chat) == _text(whole, is_chat) == "".join(map(chr, _token_ids(whole)))
            assert whole["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_resumed_with_its_generated_tokens_continues_identically(engine: SimEngine) -> None:
    prompt = [7, 300, 12, 9000, 65]
    async with aiohttp.ClientSession() as session:
        _, full = await _post(
            session, engine.url, {"prompt": prompt, "max_tokens": 30, "return_token_ids": True}
        )
        generated = _token_ids(full)
        for cut in (1, 13, 29):
            _, resumed = await _post(
                session,
                engine.url,
                {"prompt": prompt + generated[:cut], "max_tokens": 30 - cut, "return_token_ids": True},
            )
            assert _token_ids(resumed) == generated[cut:]


@pytest.mark.asyncio(loop_scope="module")
async def test_stop_strings_and_stop_token_ids_end_a_request_like_vllm(engine: SimEngine) -> None:
    async with aiohttp.ClientSession() as session:
        _, free = await _post(
            session, engine.url, {"prompt": "abc", "max_tokens": 60, "return_token_ids": True}
        )
        text = free["choices"][0]["text"]
        stop = text[20:22]
        cut = text.index(stop)
        for stream in (False, True):
            _, stopped = await _post(
                session,
                engine.url,
                {
                    "prompt": "abc",
                    "max_tokens": 60,
                    "stop": [stop],
                    "return_token_ids": True,
                    "stream": stream,
                },
            )
            assert _text(stopped, chat=False) == text[:cut]
            assert _token_ids(stopped) == _token_ids(free)[: cut + len(stop)]
            last = stopped[-1] if stream else stopped
            assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == ("stop", stop)
        _, kept = await _post(
            session,
            engine.url,
            {"prompt": "abc", "max_tokens": 60, "stop": stop, "include_stop_str_in_output": True},
        )
        assert kept["choices"][0]["text"] == text[: cut + len(stop)]
        stop_id = _token_ids(free)[5]
        _, by_id = await _post(
            session,
            engine.url,
            {"prompt": "abc", "max_tokens": 60, "stop_token_ids": [stop_id], "return_token_ids": True},
        )
        first = _token_ids(free).index(stop_id)
        assert _token_ids(by_id) == _token_ids(free)[: first + 1]
        assert by_id["choices"][0]["stop_reason"] == stop_id


class _SnapshotLog:
    """Every snapshot an engine publishes from the first one `wait_for` sees: ZMQ drops what is
    published before a subscription is in place, so a test waits for one before it acts."""

    def __init__(self, addr: str) -> None:
        self.snapshots: list[EngineSnapshot] = []
        self._subscriber = SnapshotSubscriber(addr)
        self._arrived = asyncio.Condition()
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        while True:
            snapshot = await self._subscriber.receive(timeout_s=0.5)
            if snapshot is not None:
                async with self._arrived:
                    self.snapshots.append(snapshot)
                    self._arrived.notify_all()

    async def wait_for(self, predicate: Callable[[EngineSnapshot], bool], what: str,
                       timeout_s: float = 30.0) -> None:
        """Until a snapshot arrives, from now on, for which `predicate` holds."""
        start = len(self.snapshots)

        def arrived() -> bool:
            return any(predicate(s) for s in self.snapshots[start:])

        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(arrived), timeout_s)
            except TimeoutError:
                raise AssertionError(f"no snapshot {what} within {timeout_s} s") from None

    async def close(self) -> list[EngineSnapshot]:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._subscriber.close()
        return self.snapshots


def _idle(snapshot: EngineSnapshot) -> bool:
    return not snapshot.running and not snapshot.waiting


def _assert_blocks_add_up(snapshot: EngineSnapshot) -> None:
    held = sum(r.blocks for r in snapshot.running)
    assert held + snapshot.free_blocks == snapshot.total_blocks
    for request in snapshot.running:
        assert request.blocks == math.ceil(request.computed_tokens / snapshot.block_size), request
        assert request.computed_tokens <= request.prompt_tokens + request.output_tokens
    assert all(r.blocks == 0 for r in snapshot.waiting)


@pytest.mark.asyncio(loop_scope="module")
async def test_snapshots_follow_every_step_with_exact_block_accounting(engine: SimEngine) -> None:
    log = _SnapshotLog(engine.snapshot_addr)
    await log.wait_for(lambda _: True, "at all")
    bodies = [
        {"prompt": [40 + i] * (50 + 37 * i), "max_tokens": 60, "kv_transfer_params": {"llumlet_id": f"L{i}"}}
        for i in range(5)
    ]
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(_post(session, engine.url, body) for body in bodies))
    await log.wait_for(_idle, "of the idle engine")
    snapshots = await log.close()
    steps = [s.step for s in snapshots]
    assert steps == sorted(set(steps))
    assert steps[-1] - steps[0] >= 60  # at least one step (and snapshot) per generated token
    for snapshot in snapshots:
        assert snapshot.engine_id == "tiny" and snapshot.block_size == 32 and snapshot.total_blocks == 64
        _assert_blocks_add_up(snapshot)
    seen = {r.request_id for s in snapshots for r in s.running}
    assert seen == {f"L{i}" for i in range(5)}  # tracked by the llumlet's id, as the connector does
    assert snapshots[-1].free_blocks == 64 and not snapshots[-1].running


@pytest.mark.asyncio(loop_scope="module")
async def test_a_small_block_pool_queues_and_preempts_without_changing_tokens(
    engine: SimEngine, tmp_path: Path
) -> None:
    # At a quarter of the fast clock: the four requests (sent together) overlap, and so compete for
    # the 40 blocks, however slowly the test sends them (each ran about 0.25 s at 20x).
    small = await _started(
        tmp_path,
        "small",
        "--model",
        "tiny",
        "--block-size",
        "16",
        "--num-blocks",
        "40",
        "--max-model-len",
        "512",
        "--time-scale",
        "5",
    )
    try:
        log = _SnapshotLog(small.snapshot_addr)
        await log.wait_for(lambda _: True, "at all")
        bodies = [{"prompt": [60 + i] * 120, "max_tokens": 150, "return_token_ids": True} for i in range(4)]
        async with aiohttp.ClientSession() as session:
            constrained = await asyncio.gather(*(_post(session, small.url, b) for b in bodies))
            roomy = await asyncio.gather(*(_post(session, engine.url, b) for b in bodies))
            async with session.get(small.url + "/metrics") as response:
                metrics = parse_engine_metrics(await response.text())
        await log.wait_for(_idle, "of the idle engine")
        snapshots = await log.close()
    finally:
        assert small.stop() == 0
    assert [_token_ids(r) for _, r in constrained] == [_token_ids(r) for _, r in roomy]
    assert any(s.waiting for s in snapshots)
    assert snapshots[-1].preemptions_total > 0
    assert metrics.preemptions_total == snapshots[-1].preemptions_total
    for snapshot in snapshots:
        _assert_blocks_add_up(snapshot)


@pytest.mark.asyncio(loop_scope="module")
async def test_metrics_agree_with_snapshots(tmp_path: Path) -> None:
    # A slow clock: the state stays put for a whole iteration while both are read.
    slow = await _started(
        tmp_path,
        "slow",
        "--model",
        "tiny",
        "--block-size",
        "16",
        "--num-blocks",
        "100",
        "--time-scale",
        "0.05",
    )
    try:
        subscriber = SnapshotSubscriber(slow.snapshot_addr)
        async with aiohttp.ClientSession() as session:
            requests = [
                asyncio.create_task(
                    _post(session, slow.url, {"prompt": [9] * (70 + 50 * i), "max_tokens": 3})
                )
                for i in range(3)
            ]
            matched = False
            while not matched:
                snapshot = await subscriber.receive(timeout_s=5)
                assert snapshot is not None
                async with session.get(slow.url + "/metrics") as response:
                    metrics = parse_engine_metrics(await response.text())
                if await subscriber.receive(timeout_s=0) is not None:
                    continue  # the engine stepped while /metrics was read
                if len(snapshot.running) == 3 and all(r.output_tokens for r in snapshot.running):
                    # The snapshot offers the blocks above the 1% admission watermark (one of 100);
                    # the engine's own metrics count them all, as vLLM's do.
                    assert (metrics.total_blocks, snapshot.total_blocks) == (100, 99)
                    assert metrics.block_size == snapshot.block_size == 16
                    assert metrics.free_blocks == snapshot.free_blocks + 1
                    assert (metrics.running, metrics.waiting) == (3, 0)
                    matched = True
            await asyncio.gather(*requests)
            async with session.get(slow.url + "/metrics") as response:
                text = await response.text()
        subscriber.close()
    finally:
        assert slow.stop() == 0
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 3.0' in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 9.0' in text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 360.0' in text


async def _wait_idle(engine: SimEngine, timeout_s: float = 5.0) -> EngineSnapshot:
    subscriber = SnapshotSubscriber(engine.snapshot_addr)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            snapshot = await subscriber.receive(timeout_s=0.5)
            if snapshot is not None and not snapshot.running and not snapshot.waiting:
                return snapshot
    finally:
        subscriber.close()
    raise AssertionError("the engine did not become idle")


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_disconnects_frees_its_blocks(real_time_engine: SimEngine, stream: bool) -> None:
    # Still running when the client goes away, however far behind the engine's snapshots the test
    # reads: its 312 tokens (what the context leaves) take about 8 s here, 0.4 s on the fast engine.
    engine = real_time_engine
    body = {"prompt": [5] * 200, "max_tokens": 480, "stream": stream}
    async with aiohttp.ClientSession() as session:
        async with session.get(engine.url + "/metrics") as response:
            aborted_before = _aborted(await response.text())
        subscriber = SnapshotSubscriber(engine.snapshot_addr)
        request = asyncio.create_task(_post(session, engine.url, body))
        running = None
        while running is None:
            snapshot = await subscriber.receive(timeout_s=5)
            assert snapshot is not None
            running = snapshot if any(r.output_tokens for r in snapshot.running) else None
        subscriber.close()
        assert running.free_blocks < running.total_blocks
        request.cancel()  # the client goes away mid-generation
        await asyncio.gather(request, return_exceptions=True)
        idle = await _wait_idle(engine)
        assert idle.free_blocks == idle.total_blocks
        async with session.get(engine.url + "/metrics") as response:
            assert _aborted(await response.text()) == aborted_before + 1


def _aborted(metrics_text: str) -> float:
    prefix = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} '
    return float(next(line for line in metrics_text.splitlines() if line.startswith(prefix))[len(prefix) :])


@pytest.mark.asyncio(loop_scope="module")
async def test_sixteen_engines_run_side_by_side_and_stay_small(tmp_path: Path) -> None:
    engines = [SimEngine(tmp_path, f"e{i}", "--time-scale", "10") for i in range(16)]
    for engine in engines:
        engine.launch()
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(e.wait_healthy(session, timeout_s=60) for e in engines))
            answers = await asyncio.gather(
                *(
                    _post(session, e.url, {"prompt": "hi", "max_tokens": 8, "return_token_ids": True})
                    for e in engines
                )
            )
        assert len({tuple(_token_ids(r)) for _, r in answers}) == 1  # same seed, same tokens everywhere
        assert max(e.rss_mib() for e in engines) < 80
    finally:
        assert [e.stop() for e in engines] == [0] * 16
