"""Live migration between two real CPU vLLM engines, driven over the engine channel the way a llumlet
does (no llumlet here): stages while the request decodes on A, final stage + abort, resume on B with
prompt + generated tokens, over tcp and over a gloo pair channel the destination engine opened.
Greedy output must equal the unmigrated run; KV stages zeroed on the way (a relay between the
engines) must not; a migration whose staging is gone must be recomputed, not
crash or produce garbage.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from zeroing_kv_relay import ZeroingKVRelay

from llumnix.engine.engine_channel import (
    EngineCommandClient,
    MigrationEventSubscriber,
    control_address,
    events_address,
)
from llumnix.engine.handshake import KV_SECRET_FIELD, incompatibilities, migration_key, read_handshake
from llumnix.engine.snapshots import SnapshotSubscriber
from llumnix.launch.engine_process import EngineLaunchConfig, EngineProcess
from llumnix.launch.pair import free_port
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_LOAD_FAILED,
    MIGRATION_EVENT_KIND_LOADED,
    MIGRATION_EVENT_KIND_STAGE_RECEIVED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    CancelExport,
    DropStaging,
    EngineCommand,
    ExportFinal,
    ExportStage,
    MigrationEvent,
    OpenChannel,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    # Generous: two engines start in ~40 s on an idle 2-core machine, minutes on a loaded one.
    pytest.mark.timeout(1200),
]

BLOCK_SIZE = 32
PROMPT = [(17 * i + 5) % 250 + 3 for i in range(40)]  # 40 token ids: two blocks, the second partial
MAX_TOKENS = 64
STREAM_MAX_TOKENS = 4000
"""What a streamed (migrated) request asks for: it decodes for thousands of steps past its last mark,
so it is still running when the test's commands reach the engine, whatever the machine's speed (a
client under a CPU hog was seen 400 tokens behind its engine); the client disconnects after the last
mark (vLLM aborts it) and compares the first MAX_TOKENS tokens."""


@dataclass
class Engine:
    process: EngineProcess
    commands: EngineCommandClient
    events: MigrationEventSubscriber
    snapshots: SnapshotSubscriber
    handshake: dict[str, Any]
    session: aiohttp.ClientSession

    @property
    def kv_address(self) -> str:
        return str(self.handshake["kv_address"])

    def kv_key(self, migration_id: str) -> bytes:
        """What its receiver requires of a migration's frames (its llumlet hands it out in Propose)."""
        return migration_key(str(self.handshake[KV_SECRET_FIELD]), migration_id)

    async def command(self, **body: Any) -> None:
        reply = await self.commands.send(EngineCommand(schema_version=1, **body))
        assert reply.ok, reply.error

    async def event(self, predicate: Callable[[MigrationEvent], bool],
                    timeout_s: float = 30) -> MigrationEvent:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            event = await self.events.receive(0.5)
            if event is not None and predicate(event):
                return event
        raise AssertionError("no matching migration event within the timeout")

    async def complete(self, prompt: list[int], max_tokens: int, **kv_params: Any) -> list[int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": kv_params}
        async with self.session.post(f"{self.process.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            return (await response.json())["choices"][0]["token_ids"]

    async def wait_all_blocks_free(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snapshot = await self.snapshots.receive(0.5)
            if snapshot and not snapshot.running and snapshot.free_blocks == snapshot.total_blocks:
                return
        raise AssertionError("the engine kept blocks after the migration")


async def _start(work: Path, name: str, model: Path, session: aiohttp.ClientSession) -> Engine:
    addr = f"ipc://{work}/{name}.sock"
    process = EngineProcess(EngineLaunchConfig(
        model=model, port=free_port(), served_model_name="tiny", dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=4096, snapshot_addr=addr, engine_id=name, log_path=work / f"{name}.log",
        connector_extra={"staging_lease_s": 60},
    ))
    await process.start(timeout_s=840)
    return Engine(process, EngineCommandClient(control_address(addr), timeout_s=10),
                  MigrationEventSubscriber(events_address(addr)), SnapshotSubscriber(addr),
                  read_handshake(Path(f"{work}/{name}.sock.handshake.json")), session)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(long_context_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[tuple[Engine, Engine]]:
    work = tmp_path_factory.mktemp("migration")
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    started = await asyncio.gather(*(_start(work, name, long_context_tiny_model_dir, session)
                                     for name in ("a", "b")),
                                   return_exceptions=True)
    try:
        for result in started:
            if isinstance(result, BaseException):
                raise result
        yield started[0], started[1]
    finally:
        for engine in started:
            if isinstance(engine, Engine):
                engine.commands.close()
                engine.events.close()
                engine.snapshots.close()
                await engine.process.stop()
        await session.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(engines: tuple[Engine, Engine]) -> list[int]:
    """The unmigrated greedy output."""
    source, destination = engines
    tokens = await source.complete(PROMPT, MAX_TOKENS, llumlet_id="reference")
    assert tokens == await destination.complete(PROMPT, MAX_TOKENS, llumlet_id="reference-b")
    return tokens


async def _stream_until(source: Engine, request_id: str, marks: list[int],
                        at_mark: Callable[[int], Any]) -> list[int]:
    """Streams PROMPT on the source; calls `at_mark(n)` (awaited) once n tokens arrived, for each mark;
    disconnects (vLLM aborts the request) after the last mark. Returns the tokens the client saw."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": STREAM_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "kv_transfer_params": {"llumlet_id": request_id}}
    generated: list[int] = []
    pending = list(marks)
    response = await source.session.post(f"{source.process.url}/v1/completions", json=body)
    try:
        assert response.status == 200, await response.text()
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            generated += json.loads(text[6:])["choices"][0].get("token_ids") or []
            while pending and len(generated) >= pending[0]:
                await at_mark(pending.pop(0))
            if not pending:
                break
    finally:
        response.close()  # the client disconnect: vLLM aborts the request
    assert not pending, f"the request finished after {len(generated)} tokens, before every mark"
    return generated[:marks[-1]]


@dataclass
class Migrated:
    generated: list[int]  # tokens the client saw from the source
    resumed: list[int]  # tokens from the destination
    sent: list[MigrationEvent]  # the source's events for the migration, final stage last


async def _migrate(source: Engine, destination: Engine, name: str, kv_address: str = "",
                   transport: str = "tcp") -> Migrated:
    """Two live stages, then the final one, then the resumed request on the destination. The source
    sends to `kv_address` (default: the destination's KV receiver) over `transport`; for a pair channel
    the destination engine opens it first (OpenChannel), as its llumlet does in Propose."""
    migration: dict[str, Any] = {"migration_id": name, "request_id": name,
                                 "kv_address": kv_address or destination.kv_address, "transport": transport,
                                 "kv_key": destination.kv_key(name)}
    if transport != "tcp":
        opened = await destination.commands.send(EngineCommand(
            schema_version=1, open_channel=OpenChannel(backend=transport, migration_id=name)))
        assert opened.ok, opened.error
        assert opened.channel.backend == transport and opened.channel.channel_id
        migration["channel"] = opened.channel

    sent: list[MigrationEvent] = []

    async def at_mark(count: int) -> None:
        if count < 40:
            await source.command(export_stage=ExportStage(**migration))
            # Sent before the next mark: a client far behind the engine reaches its marks at once, and
            # stages still pending when the request ends are superseded by the final one.
            sent.append(await source.event(lambda e: e.migration_id == name))
        else:
            await source.command(export_final=ExportFinal(**migration))

    generated = await _stream_until(source, name, [10, 25, 40], at_mark)
    sent.append(await source.event(lambda e: e.migration_id == name))
    while not sent[-1].final:
        sent.append(await source.event(lambda e: e.migration_id == name))
    for event in sent:
        assert event.kind == MIGRATION_EVENT_KIND_STAGE_SENT, event.error
    resumed = await destination.complete(
        PROMPT + generated, MAX_TOKENS - len(generated), llumlet_id=f"{name}-resumed",
        llumlet_migration_id=name, llumlet_staged_tokens=sent[-1].num_tokens,
    )
    return Migrated(generated, resumed, sent)


async def test_handshake_records_carry_the_kv_receivers(engines: tuple[Engine, Engine]) -> None:
    source, destination = engines
    assert source.kv_address.startswith("tcp://127.0.0.1:")
    assert source.handshake["kv_channels"] == destination.handshake["kv_channels"] == ["tcp", "gloo"]
    assert source.kv_address != destination.kv_address
    assert incompatibilities(source.handshake, destination.handshake) == []


async def test_unknown_requests_are_refused(engines: tuple[Engine, Engine]) -> None:
    source, destination = engines
    reply = await source.commands.send(EngineCommand(schema_version=1, export_stage=ExportStage(
        migration_id="x", request_id="nobody", kv_address=destination.kv_address)))
    assert not reply.ok and "unknown request" in reply.error


async def test_migrated_request_continues_exactly(engines: tuple[Engine, Engine],
                                                  reference: list[int]) -> None:
    source, destination = engines
    migrated = await _migrate(source, destination, "live")
    assert migrated.generated + migrated.resumed == reference
    assert [e.stage for e in migrated.sent] == [1, 2, 3]
    assert all(e.copy_ms > 0 and e.send_ms > 0 and e.bytes > 0 for e in migrated.sent)
    generated = migrated.generated
    loaded = await destination.event(lambda e: e.migration_id == "live" and e.kind in (
        MIGRATION_EVENT_KIND_LOADED, MIGRATION_EVENT_KIND_LOAD_FAILED))
    assert loaded.kind == MIGRATION_EVENT_KIND_LOADED, loaded.error
    # All but the last token of prompt + generated came from staging or the destination's prefix cache:
    # it ran the reference (the same tokens), so vLLM finds their full blocks cached there and the
    # connector loads only the rest.
    assert loaded.num_tokens == len(PROMPT) + len(generated) - 1
    cached_there = loaded.num_tokens // BLOCK_SIZE
    assert loaded.blocks == -(-loaded.num_tokens // BLOCK_SIZE) - cached_there
    await source.wait_all_blocks_free()  # the delayed free ended once the final stage was copied


async def test_a_migration_over_a_gloo_channel_continues_exactly(engines: tuple[Engine, Engine],
                                                                reference: list[int]) -> None:
    """The pair-channel path NCCL takes on GPUs (rendezvous opened by the destination engine, carried
    in the export commands, payloads point to point), here with gloo between two CPU engines."""
    source, destination = engines
    migrated = await _migrate(source, destination, "gloo", transport="gloo")
    assert migrated.generated + migrated.resumed == reference
    assert [e.stage for e in migrated.sent] == [1, 2, 3] and all(e.bytes > 0 for e in migrated.sent)
    loaded = await destination.event(lambda e: e.migration_id == "gloo" and e.kind in (
        MIGRATION_EVENT_KIND_LOADED, MIGRATION_EVENT_KIND_LOAD_FAILED))
    assert loaded.kind == MIGRATION_EVENT_KIND_LOADED, loaded.error
    assert loaded.num_tokens == len(PROMPT) + len(migrated.generated) - 1
    await source.wait_all_blocks_free()


async def test_an_nccl_channel_is_refused_by_an_engine_without_cuda(engines: tuple[Engine, Engine]) -> None:
    _, destination = engines
    reply = await destination.commands.send(EngineCommand(
        schema_version=1, open_channel=OpenChannel(backend="nccl", migration_id="n")))
    assert not reply.ok and "needs a CUDA GPU" in reply.error


async def test_stages_are_incremental(engines: tuple[Engine, Engine], reference: list[int]) -> None:
    source, destination = engines
    received: list[MigrationEvent] = []
    migrated = await _migrate(source, destination, "stages")
    assert migrated.generated + migrated.resumed == reference
    # The receiver publishes after it stored a stage: the last event may trail the resumed request.
    while not received or not received[-1].final:
        received.append(await destination.event(
            lambda e: e.migration_id == "stages" and e.kind == MIGRATION_EVENT_KIND_STAGE_RECEIVED))
    assert [e.stage for e in received] == [1, 2, 3] and received[-1].final
    tokens = [e.num_tokens for e in received]
    assert tokens == sorted(tokens) and tokens[0] >= len(PROMPT) + 10 - 1
    # Stage 1 sends every block; later stages only the re-sent tail and new blocks.
    assert received[0].blocks == -(-tokens[0] // BLOCK_SIZE)
    for previous, stage in itertools.pairwise(received):
        assert stage.blocks == -(-stage.num_tokens // BLOCK_SIZE) - previous.num_tokens // BLOCK_SIZE


async def test_zero_kv_control_diverges(engines: tuple[Engine, Engine], reference: list[int]) -> None:
    source, destination = engines
    relay = ZeroingKVRelay(destination.kv_address)
    try:
        migrated = await _migrate(source, destination, "zeros", kv_address=relay.address)
    finally:
        relay.close()
    assert relay.frames == len(migrated.sent) == 3
    loaded = await destination.event(lambda e: e.migration_id == "zeros" and e.kind in (
        MIGRATION_EVENT_KIND_LOADED, MIGRATION_EVENT_KIND_LOAD_FAILED))
    assert loaded.kind == MIGRATION_EVENT_KIND_LOADED, loaded.error  # the zeros were loaded, not recomputed
    split = len(migrated.generated)
    assert migrated.generated == reference[:split]
    assert migrated.resumed != reference[split:], "loading zeros gave the right output: the load is unused"


async def test_dropped_staging_is_recomputed(engines: tuple[Engine, Engine], reference: list[int]) -> None:
    source, destination = engines
    migration = {"migration_id": "dropped", "request_id": "dropped", "kv_address": destination.kv_address,
                 "kv_key": destination.kv_key("dropped")}

    async def at_mark(count: int) -> None:
        await source.command(export_stage=ExportStage(**migration))
        stage = await source.event(lambda e: e.migration_id == "dropped")
        assert stage.kind == MIGRATION_EVENT_KIND_STAGE_SENT, stage.error
        await source.command(cancel_export=CancelExport(migration_id="dropped"))
        await destination.command(drop_staging=DropStaging(migration_id="dropped"))

    generated = await _stream_until(source, "dropped", [12], at_mark)
    resumed = await destination.complete(
        PROMPT + generated, MAX_TOKENS - len(generated), llumlet_id="dropped-resumed",
        llumlet_migration_id="dropped", llumlet_staged_tokens=len(PROMPT) + len(generated) - 1,
    )
    failed = await destination.event(lambda e: e.migration_id == "dropped" and e.kind in (
        MIGRATION_EVENT_KIND_LOADED, MIGRATION_EVENT_KIND_LOAD_FAILED))
    assert failed.kind == MIGRATION_EVENT_KIND_LOAD_FAILED and "no staging" in failed.error
    assert generated + resumed == reference  # recomputed, not garbage
    await source.wait_all_blocks_free()
