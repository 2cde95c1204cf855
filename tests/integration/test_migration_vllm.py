"""Live migration through llumlets between two real CPU vLLM engines with the tiny model: greedy
requests migrated at random points (some twice, A -> B -> A) under background load produce exactly
their unmigrated tokens; KV stages zeroed on their way to the destination (a relay in front of its
engine's KV receiver) do not (so the KV is what makes them exact). Every failure path keeps the
caller's tokens exact and leaves both instances idle: a destination that cannot run the resumed
request, or does not answer Commit in time, makes the source resume it by recompute; a destination
that refuses (full) or is unreachable leaves the request on the source; a request that finishes on
the source mid-migration ends the migration; a source that dies after the final stage (before or
after Commit; it runs as faulty_llumlet, which crashes there) leaves the router's token replay to
finish the request, and the destination drops what it holds when its lease runs out; a destination
engine that dies mid-stage aborts the migration and the source continues. Migrations negotiated onto
a gloo pair channel (the code path of NCCL on GPUs) are exact too, and a channel mismatch is refused.

Engine B runs a shorter context than A (the handshake does not compare context lengths): long
requests moved to B fail at commit, which is how the recompute path is reached.

Nothing here depends on how fast the engines are: a migrated request asks for far more tokens than
the test reads (`LONG`), so it is still decoding when its migration starts and ends; the test reads the
tokens it compares and then aborts the request. Outcomes that hinge on an order of events (a request
ending while it migrates) are driven by a destination the test controls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
from waiting import wait_until, wait_until_async
from zeroing_kv_relay import ZeroingKVRelay

from llumnix.engine.handshake import default_handshake_path, migration_key, read_handshake, write_handshake
from llumnix.engine.kv_staging import StagingStore
from llumnix.engine.kv_transport_tcp import TcpKVReceiver
from llumnix.launch.llumlet_process import LlumletProcess
from llumnix.launch.pair import EnginePair, PairConfig, free_port
from llumnix.llumlet_client import llumlet_channel
from llumnix.router.api import ApiSettings
from llumnix.router.server import Router
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not importable (install the cpu extra: bash scripts/setup.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(1500),  # the first test also waits for two engines to start
]

StartRouter = Callable[..., Awaitable[Router]]
MODEL = "tiny"
A_MAX_MODEL_LEN = 4096  # long_context_tiny_model_dir's max_position_embeddings
B_MAX_MODEL_LEN = 3072
LONG = 2900
"""max_tokens of a migrated request: it runs on either engine and decodes hundreds of steps beyond
what the test reads, whatever the machine's speed."""
STAGING_FOREVER = ("--migration-max-stages", "1000", "--migration-final-delta-blocks", "0")
"""At least one block (the tail) is always left to send: no final stage starts before 1000 stages."""
# A CPU engine stepping 30 requests can take longer than the default health-check timeout (0.5 s);
# two missed checks would fail every request in flight.
# The test client attaches to a migrated request where the router would, after Commit answers; starved by
# a CPU hog in its own scheduling group it has taken over 10 s (the default lease) to do so. Tests of lease
# expiry pass a short lease of their own.
LLUMLET_ARGS = ("--max-concurrent-migrations", "4", "--engine-check-interval", "2",
                "--migration-lease", "120")


@dataclasses.dataclass
class Node:
    pair: EnginePair
    channel: grpc.aio.Channel
    api: llumlet_pb2_grpc.LlumletStub
    migration: migration_pb2_grpc.LlumletMigrationStub
    llumlet_args: tuple[str, ...] = ()

    @classmethod
    def of(cls, pair: EnginePair) -> Node:
        # The product's channel options: reconnected within 2 s of a restart, however long it was down.
        channel = llumlet_channel(pair.grpc_address)
        return cls(pair, channel, llumlet_pb2_grpc.LlumletStub(channel),
                   migration_pb2_grpc.LlumletMigrationStub(channel))

    async def restart_llumlet(self, *args: str, module: str = "llumlet", always: bool = False) -> None:
        """The same engine behind a llumlet (`module`: or a wrapper of its CLI) started with other flags
        (unless it runs with these already and `always` is not set: restarts cost seconds)."""
        config = self.pair.llumlet.config
        if args == self.llumlet_args and module == config.module and not always:
            return
        self.llumlet_args = args
        await self.pair.llumlet.stop()
        self.pair.llumlet = LlumletProcess(dataclasses.replace(config, module=module,
                                                               extra_args=(*LLUMLET_ARGS, *args)))
        self.pair.llumlet.start()
        await self.pair.llumlet.wait_ready(60)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(long_context_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> AsyncIterator[tuple[Node, Node]]:
    work = tmp_path_factory.mktemp("migration-vllm")
    tiny_model_dir = long_context_tiny_model_dir
    pairs = [EnginePair(PairConfig(instance_id="a", work_dir=work / "a", model_dir=tiny_model_dir,
                                   max_model_len=A_MAX_MODEL_LEN, shutdown_grace_s=5.0,
                                   llumlet_args=LLUMLET_ARGS, engine_start_timeout_s=900.0)),
             EnginePair(PairConfig(instance_id="b", work_dir=work / "b", model_dir=tiny_model_dir,
                                   max_model_len=B_MAX_MODEL_LEN, shutdown_grace_s=5.0,
                                   llumlet_args=LLUMLET_ARGS, engine_start_timeout_s=900.0))]
    try:
        await asyncio.gather(*(p.start() for p in pairs))
        a, b = Node.of(pairs[0]), Node.of(pairs[1])
        yield a, b
        await a.channel.close()
        await b.channel.close()
    finally:
        await asyncio.gather(*(p.stop() for p in pairs), return_exceptions=True)


async def _engine_output_tokens(node: Node, request_id: str) -> int | None:
    """The tokens the engine itself has decoded for a running request (its snapshot, not the stream
    the llumlet has read so far); None when it runs no such request."""
    load = await node.api.GetLoad(pb.GetLoadRequest())
    return next((r.output_tokens for r in load.running if r.request_id == request_id), None)


def _body(seed: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    prompt = [(seed * 131 + i * 17) % 400 + 10 for i in range(prompt_len)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@dataclasses.dataclass
class Run:
    """One request's stream, read in the background, possibly across moves."""

    node: Node
    request_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    moved: pb.Moved | None = None
    moved_at: int = 0
    """Tokens the caller had when the stream last ended with Moved (where the request moved)."""
    reader: asyncio.Task[None] | None = None
    grown: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @classmethod
    def start(cls, node: Node, request_id: str, body: dict[str, Any]) -> Run:
        run = cls(node, request_id)
        run._read(node.api.Generate(pb.GenerateRequest(
            request_id=request_id, endpoint=pb.ENDPOINT_COMPLETION, body_json=json.dumps(body))))
        return run

    def _read(self, call: Any) -> None:
        self.moved = None
        self.reader = asyncio.create_task(self._consume(call))

    async def _consume(self, call: Any) -> None:
        try:
            async for message in call:
                if message.HasField("moved"):
                    self.moved = message.moved
                    self.moved_at = len(self.tokens)
                else:
                    self.tokens += message.chunk.token_ids
                    self.grown.set()
        finally:
            self.grown.set()

    @property
    def done(self) -> bool:
        return self.reader is not None and self.reader.done()

    async def until(self, count: int, timeout_s: float = 300.0) -> None:
        """Waits for `count` tokens; fails if the stream ends (or moves) first."""
        async with asyncio.timeout(timeout_s):
            while len(self.tokens) < count:
                assert not self.done, f"{self.request_id} ended after {len(self.tokens)} of {count} tokens"
                self.grown.clear()
                await self.grown.wait()

    async def follow(self, node: Node) -> None:
        """After a committed move to `node`: the stream ended with Moved; attach to it there."""
        assert self.reader is not None
        await self.reader
        assert self.moved is not None, f"{self.request_id} ended without a move"
        assert self.moved.instance_id == node.pair.config.instance_id
        self.node = node
        self._read(self.node.api.Generate(pb.GenerateRequest(request_id=self.request_id, attach=True)))

    async def stop(self, count: int) -> list[int]:
        """Reads `count` tokens, then aborts the request where it runs; returns those tokens."""
        await self.until(count)
        await self.node.api.Abort(pb.AbortRequest(request_id=self.request_id))
        assert self.reader is not None
        await self.reader
        assert self.moved is None
        return self.tokens[:count]

    async def finish(self) -> list[int]:
        assert self.reader is not None
        await self.reader
        assert self.moved is None
        return self.tokens


async def _generate(node: Node, request_id: str, body: dict[str, Any]) -> list[int]:
    return await Run.start(node, request_id, body).finish()


async def _migrate(source: Node, destination: Node, request_id: str,
                   timeout_s: float = 30.0) -> mpb.MigrateOutResponse:
    """MigrateOut, retried while either end is busy with another migration."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await source.migration.MigrateOut(mpb.MigrateOutRequest(
            destination_instance_id=destination.pair.config.instance_id,
            destination_address=destination.pair.grpc_address, request_id=request_id), timeout=60)
        busy = result.outcome == mpb.MIGRATION_OUTCOME_BUSY or (
            result.outcome == mpb.MIGRATION_OUTCOME_REFUSED and "migration(s)" in result.reason)
        if not busy or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.02)


async def _wait_idle(node: Node, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        # wait_for_ready: a llumlet restarted after a crash is reached once its channel reconnects.
        load = await node.api.GetLoad(pb.GetLoadRequest(), wait_for_ready=True, timeout=timeout_s)
        # Every block free: no delayed-free block of a final stage is left either.
        if not load.running and not load.waiting and not load.reserved_blocks and not load.migrating_in \
                and not load.migrating_out and load.free_blocks == load.total_blocks:
            return
        assert time.monotonic() < deadline, f"not idle: {load}"
        await asyncio.sleep(0.1)


def _log_lines(request_id: str, *nodes: Node) -> str:
    """The llumlets' log lines about one request: what ended it where, when a hop did not commit."""
    lines = []
    for node in nodes:
        path = node.pair.llumlet.config.log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        lines += [f"{node.pair.config.instance_id}: {line}" for line in text.splitlines()
                  if f'"{request_id}"' in line]
    return "\n".join(lines[-20:])


async def _migrated_run(nodes: tuple[Node, Node], request_id: str, body: dict[str, Any], hops: int,
                        after: list[int], want: int) -> tuple[list[int], list[mpb.MigrateOutResponse]]:
    """Runs the request on nodes[0], moves it `hops` times (after `after[i]` tokens each), and returns
    its first `want` tokens."""
    here, there = nodes
    run = Run.start(here, request_id, body)
    results: list[mpb.MigrateOutResponse] = []
    for hop in range(hops):
        await run.until(after[hop])
        result = await _migrate(here, there, request_id)
        results.append(result)
        if result.outcome != mpb.MIGRATION_OUTCOME_COMMITTED:
            load = await here.api.GetLoad(pb.GetLoadRequest())
            result.reason += (f" [hop {hop}: {len(run.tokens)} tokens read, stream ended: {run.done}, "
                              f"running there: {[r.request_id for r in load.running]}; "
                              f"{_log_lines(request_id, here, there)}]")
            break
        await run.follow(there)
        here, there = there, here
    return await run.stop(want), results


async def test_greedy_requests_migrated_at_random_points_keep_their_tokens(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    rng = random.Random(4)
    count = 24
    prompts = [rng.randint(16, 48) for _ in range(count)]
    wants = [rng.randint(120, 200) for _ in range(count)]
    expected = await asyncio.gather(*(_generate(a, f"ref-{i}", _body(i, prompt, want))
                                      for i, (prompt, want) in enumerate(zip(prompts, wants, strict=True))))
    background = [Run.start(node, f"bg-{node.pair.config.instance_id}", _body(100 + i, 32, LONG))
                  for i, node in enumerate((a, b))]
    # Fewer requests migrate at once than an instance takes (LLUMLET_ARGS): none waits for a slot, and
    # on a loaded 2-core machine a migration still ends within the hundreds of steps LONG leaves.
    slots = asyncio.Semaphore(2)

    async def migrated(i: int) -> tuple[list[int], list[mpb.MigrateOutResponse]]:
        order = (a, b) if i % 2 == 0 else (b, a)
        hops = 2 if i % 3 == 0 else 1
        after = sorted(rng.sample(range(2, 60), hops))
        async with slots:
            return await _migrated_run(order, f"m-{i}", _body(i, prompts[i], LONG), hops, after, wants[i])

    outcomes = await asyncio.gather(*(migrated(i) for i in range(count)))
    for run in background:  # load only: stop those still running
        if not run.done:
            await run.node.api.Abort(pb.AbortRequest(request_id=run.request_id))
        await run.finish()
    committed = [r for _, results in outcomes for r in results
                 if r.outcome == mpb.MIGRATION_OUTCOME_COMMITTED]
    twice = sum(1 for _, results in outcomes
                if sum(r.outcome == mpb.MIGRATION_OUTCOME_COMMITTED for r in results) == 2)
    # Every migration of a running request into an instance with room commits.
    assert len(committed) == sum(2 if i % 3 == 0 else 1 for i in range(count)), \
        [r for _, results in outcomes for r in results if r.outcome != mpb.MIGRATION_OUTCOME_COMMITTED]
    assert twice == sum(1 for i in range(count) if i % 3 == 0)
    assert all(r.migrated_tokens > 0 and r.bytes > 0 for r in committed)
    for (tokens, results), want in zip(outcomes, expected, strict=True):
        assert tokens == want, results
    await _wait_idle(a)
    await _wait_idle(b)


async def test_greedy_requests_migrate_over_a_gloo_channel_negotiated_in_propose(
        nodes: tuple[Node, Node]) -> None:
    """A's llumlet asks for gloo, B's is on auto: every migration, either way, runs on a gloo pair
    channel whose rendezvous B's (or A's) engine opened and Propose's answer carried, and stays exact;
    B restricted to tcp refuses A's gloo with the reason, and the request stays on A untouched."""
    a, b = nodes
    await a.restart_llumlet("--migration-transport", "gloo")
    await b.restart_llumlet()
    try:
        count = 4
        expected = await asyncio.gather(*(_generate(a, f"gref-{i}", _body(200 + i, 40, 160))
                                          for i in range(count)))
        outcomes = await asyncio.gather(*(
            _migrated_run((a, b) if i % 2 == 0 else (b, a), f"g-{i}", _body(200 + i, 40, LONG),
                          2 if i < 2 else 1, [10, 30], 160) for i in range(count)))
        for (tokens, results), want in zip(outcomes, expected, strict=True):
            assert [(r.outcome, r.transport) for r in results] == \
                [(mpb.MIGRATION_OUTCOME_COMMITTED, "gloo")] * len(results), results
            assert all(r.migrated_tokens > 0 and r.bytes > 0 for r in results)
            assert tokens == want, results
        await b.restart_llumlet("--migration-transport", "tcp")
        run = Run.start(a, "g-refused", _body(200, 40, LONG))
        await run.until(10)
        refused = await _migrate(a, b, "g-refused")
        assert refused.outcome == mpb.MIGRATION_OUTCOME_REFUSED, refused
        assert "migrates KV over gloo only, the destination over tcp only" in refused.reason, refused
        assert await run.stop(160) == expected[0]
    finally:
        await a.restart_llumlet()
        await b.restart_llumlet()
    await _wait_idle(a)
    await _wait_idle(b)


@contextlib.contextmanager
def _zeroing_relay_in_front_of(node: Node) -> Iterator[ZeroingKVRelay]:
    """Points the node's handshake record at a zeroing relay in front of its engine's KV receiver: its
    llumlet reads the record for every Propose and answers with the relay's address. Restored after."""
    path = default_handshake_path(node.pair.llumlet.config.snapshot_addr)
    assert path is not None
    record = read_handshake(path)
    relay = ZeroingKVRelay(str(record["kv_address"]))
    write_handshake(path, {**record, "kv_address": relay.address})
    try:
        yield relay
    finally:
        write_handshake(path, record)
        relay.close()


async def test_zero_kv_control_diverges(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    expected = await _generate(a, "zref", _body(7, 40, 1000))
    run = Run.start(a, "zkv", _body(7, 40, LONG))
    await run.until(20)
    with _zeroing_relay_in_front_of(b) as relay:
        result = await _migrate(a, b, "zkv")
    assert result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED, result
    assert relay.frames == result.stages, "the stages did not go through the relay"
    await run.follow(b)
    split = run.moved_at  # a loaded machine's client sees the move hundreds of tokens after it asked
    assert split + 100 <= len(expected), f"moved after {split} tokens: past the reference"
    tokens = await run.stop(split + 100)
    assert tokens[:split] == expected[:split]
    assert tokens[split:] != expected[split:split + 100]


async def test_commit_failure_resumes_the_request_on_the_source_by_recompute(
        nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    expected = await _generate(a, "rref", _body(8, 40, 200))
    # Asks for more than B's context: B fails the resumed request at commit.
    tokens, results = await _migrated_run((a, b), "resume", _body(8, 40, 4000), 1, [80], 200)
    assert [r.outcome for r in results] == [mpb.MIGRATION_OUTCOME_RESUMED_ON_SOURCE], results
    assert tokens == expected
    await _wait_idle(a)
    await _wait_idle(b)


async def test_a_full_or_unreachable_destination_leaves_the_request_on_the_source(
        nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    await a.restart_llumlet()
    await b.restart_llumlet("--migration-freeness-threshold", "1e9")  # no request fits: B counts as full
    expected = await _generate(a, "fref", _body(10, 40, 160))
    run = Run.start(a, "full", _body(10, 40, LONG))
    await run.until(10)
    full = await _migrate(a, b, "full")
    assert full.outcome == mpb.MIGRATION_OUTCOME_REFUSED and "room" in full.reason, full
    gone = await a.migration.MigrateOut(mpb.MigrateOutRequest(
        destination_instance_id="nowhere", destination_address=f"127.0.0.1:{free_port()}",
        request_id="full"), timeout=60)
    assert gone.outcome == mpb.MIGRATION_OUTCOME_REFUSED and "did not answer" in gone.reason, gone
    assert await run.stop(160) == expected
    await _wait_idle(a)
    await _wait_idle(b)


class GatedDestination(migration_pb2_grpc.LlumletMigrationServicer):
    """A destination llumlet whose Propose (or Renew) answers only once the test opens the gate, so the
    test decides what the request on the source does meanwhile. It stages what it receives in a real
    KV receiver and records the source's Abort."""

    def __init__(self, gated: str) -> None:
        self.gated = gated
        self.waiting = asyncio.Event()
        self.gate = asyncio.Event()
        self.aborted: list[str] = []
        self.staging: StagingStore | None = None
        self.receiver: TcpKVReceiver | None = None

    async def _pass(self, call: str) -> None:
        if call == self.gated:
            self.waiting.set()
            await self.gate.wait()

    async def Propose(self, request: mpb.ProposeMigrationRequest, context: Any
                      ) -> mpb.ProposeMigrationResponse:
        layout = json.loads(request.handshake_json)
        self.staging = StagingStore(int(layout["kv_layout"]["bytes_per_block"]), str(layout["kv_dtype"]))
        self.receiver = TcpKVReceiver("127.0.0.1", staging=self.staging)
        self.receiver.start()
        await self._pass("propose")
        # A short lease: the source renews it after its first stages.
        key = migration_key(self.receiver.kv_secret, request.migration_id)
        return mpb.ProposeMigrationResponse(accepted=True, kv_address=self.receiver.address, transport="tcp",
                                            lease_ms=100, kv_key=key)

    async def Renew(self, request: mpb.RenewMigrationRequest, context: Any) -> mpb.RenewMigrationResponse:
        await self._pass("renew")
        return mpb.RenewMigrationResponse(ok=True)

    async def Abort(self, request: mpb.AbortMigrationRequest, context: Any) -> mpb.AbortMigrationResponse:
        self.aborted.append(request.migration_id)
        return mpb.AbortMigrationResponse(released=True)


@pytest_asyncio.fixture(loop_scope="module")
async def gated_destination(request: pytest.FixtureRequest) -> AsyncIterator[tuple[GatedDestination, str]]:
    servicer = GatedDestination(request.param)
    server = grpc.aio.server()
    migration_pb2_grpc.add_LlumletMigrationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.gate.set()
        await server.stop(0)
        if servicer.receiver is not None:
            servicer.receiver.close()


@pytest.mark.parametrize(("gated_destination", "ending"), [("propose", "finishes"), ("renew", "is aborted")],
                         indirect=["gated_destination"])
async def test_a_request_ending_on_the_source_mid_migration_ends_the_migration(
        nodes: tuple[Node, Node], gated_destination: tuple[GatedDestination, str], ending: str) -> None:
    """The request finishes (its last token while Propose is pending) or is aborted by its caller
    (after a KV stage was sent): FINISHED_ON_SOURCE, the destination is told to abort, nothing leaks."""
    a, _ = nodes
    # It stages (and renews) until the request ends, and waits for the held Propose as long as the
    # request takes to finish, however slowly the engine decodes.
    await a.restart_llumlet(*STAGING_FOREVER, "--migration-peer-timeout", "300")
    destination, address = gated_destination
    # Natural finish: far longer than it takes MigrateOut to arrive (one call after its 2nd token).
    run = Run.start(a, f"ends-{destination.gated}", _body(11, 40, LONG))
    await run.until(2)
    migration = asyncio.ensure_future(a.migration.MigrateOut(mpb.MigrateOutRequest(
        destination_instance_id="gated", destination_address=address, request_id=run.request_id),
        timeout=120))
    async with asyncio.timeout(60):
        await destination.waiting.wait()
    if ending == "finishes":
        tokens = await run.finish()
        assert len(tokens) == LONG
    else:
        await a.api.Abort(pb.AbortRequest(request_id=run.request_id))
        await run.finish()
    destination.gate.set()
    result = await migration
    assert result.outcome == mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE, result
    assert (result.stages == 0) if ending == "finishes" else (result.stages >= 1), result
    assert destination.aborted == [result.migration_id]
    await _wait_idle(a)


async def test_a_commit_past_its_timeout_resumes_on_the_source_and_the_destination_stops_its_copy(
        nodes: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    # The destination starts the request but never answers Commit: the source's timeout fires.
    await a.restart_llumlet("--migration-commit-timeout", "1")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
    await b.restart_llumlet("--hold-commit-answer", module="faulty_llumlet")
    expected = await _generate(a, "tref", _body(12, 40, 160))
    tokens, results = await _migrated_run((a, b), "late", _body(12, 40, LONG), 1, [20], 160)
    assert [r.outcome for r in results] == [mpb.MIGRATION_OUTCOME_RESUMED_ON_SOURCE], results
    assert "DEADLINE_EXCEEDED" in results[0].reason
    assert tokens == expected
    await _wait_idle(a)
    await _wait_idle(b)
    await b.restart_llumlet()


@pytest.mark.parametrize("exit_at", ["final-stage", "commit"])
async def test_a_source_dying_after_the_final_stage_loses_and_repeats_no_token(
        nodes: tuple[Node, Node], start_router: StartRouter, exit_at: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    lease_s = 2.0
    await b.restart_llumlet("--migration-lease", str(lease_s))
    # faulty_llumlet lives next to this file; the llumlet process inherits this environment.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
    await a.restart_llumlet("--crash-at", exit_at, module="faulty_llumlet", always=True)
    # The engine can decode a whole request while a starved test waits for its first tokens (seen beside
    # a CPU hog with 2,000 tokens); an attempt whose request ended before its migration crossed the
    # final stage starts over with another.
    for attempt in range(3):
        # A fresh router per attempt: round robin sends its first request to "a", the source.
        router = await start_router([a.pair.grpc_address, b.pair.grpc_address],
                                    api=ApiSettings(model=MODEL), dispatch_policy="round-robin")
        body = _body(13 + attempt, 40, LONG)
        tokens: list[int] = []
        reading = asyncio.create_task(_stream_through(router.port, body, tokens))
        await wait_until(lambda tokens=tokens, reading=reading: len(tokens) >= 20 or reading.done(),
                         "20 tokens streamed", timeout_s=120)
        assert len(tokens) >= 20, "the request ended before the migration"
        try:
            answer = await a.migration.MigrateOut(mpb.MigrateOutRequest(
                destination_instance_id="b", destination_address=b.pair.grpc_address), timeout=60)
        except grpc.aio.AioRpcError as exc:  # the source kills itself mid-call
            died = exc
            break
        assert answer.outcome in (mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE,
                                  mpb.MIGRATION_OUTCOME_NO_CANDIDATE), answer
        await reading
    else:
        raise AssertionError("3 requests ended before their migration reached the final stage")
    assert died.code() == grpc.StatusCode.UNAVAILABLE
    await reading
    assert router.metrics.replays._value.get() == 1
    assert router.metrics.moves._value.get() == 0
    # What B held for the migration (a reservation, or the committed copy nobody attaches to) goes
    # with the lease; the replayed request finished.
    await _wait_idle(b, timeout_s=lease_s + 30)
    assert tokens == await _generate(b, f"sref-{exit_at}", body)
    await a.restart_llumlet(always=True)
    await _wait_idle(a)


async def _stream_through(port: int, body: dict[str, Any], tokens: list[int]) -> None:
    """Streams `body` through the router at `port`, appending the token ids as they arrive."""
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={**body, "stream": True, "return_token_ids": True}) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids") or [])


async def test_destination_death_mid_stage_aborts_and_the_source_continues(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    await a.restart_llumlet(*STAGING_FOREVER)
    # The longest request the model allows. The engine can run far ahead of a starved test and llumlet
    # (seen beside a CPU hog: a whole request decoded while its first stage was pending), so the
    # destination dies only while the engine has at least half the request left; an attempt that
    # comes too late is aborted and started over, the destination still alive.
    max_tokens = 4000
    body = _body(9, 40, max_tokens)
    expected = await _generate(a, "kref", body)
    for attempt in range(3):
        run = Run.start(a, f"kill-{attempt}", body)
        await run.until(10)
        migration = asyncio.create_task(_migrate(a, b, run.request_id))

        async def accepted(migration: asyncio.Task[mpb.MigrateOutResponse] = migration) -> bool:
            # stages begin (or the migration ended first)
            return migration.done() or bool((await b.api.GetLoad(pb.GetLoadRequest())).migrating_in)

        await wait_until_async(accepted, "b to accept the migration", timeout_s=60, poll_s=0.001)
        decoded = await _engine_output_tokens(a, run.request_id)
        if not migration.done() and decoded is not None and decoded <= max_tokens // 2:
            break
        await a.api.Abort(pb.AbortRequest(request_id=run.request_id))
        await run.finish()
        await migration
        await _wait_idle(a)
    else:
        pytest.fail("in 3 attempts the source engine had decoded over half the request before the "
                    "destination accepted its migration")
    b.pair.kill_engine()
    result = await migration
    assert result.outcome == mpb.MIGRATION_OUTCOME_ABORTED, result
    assert await run.finish() == expected
    await _wait_idle(a)
