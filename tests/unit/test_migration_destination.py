"""The destination's reservations: what Propose admits, how the load shows reservations, and that
leases, aborts and refusals leave nothing behind (staging dropped, load back to idle)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from waiting import wait_until

from llumlet.admission import Admission
from llumlet.engine_client import EngineClient, EngineUnavailableError
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration import destination as destination_module
from llumlet.migration.destination import Destination
from llumlet.migration.engine_link import EngineCommandRefused
from llumlet.migration.settings import MigrationSettings
from llumlet.requests import RequestTable
from llumnix.engine.handshake import migration_key, new_kv_secret
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.engine_pb2 import EngineRequest, EngineSnapshot
from llumnix.v1.kv_transfer_pb2 import MIGRATION_EVENT_KIND_LOADED, KVChannel, MigrationEvent

HANDSHAKE = {"model": "m", "kv_dtype": "float32", "block_size": 16, "kv_layout": {"bytes_per_block": 64},
             "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "kv_address": "tcp://127.0.0.1:9",
             "kv_channels": ["tcp", "gloo"], "kv_secret": new_kv_secret()}


class FakeLink:
    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.changed = asyncio.Event()
        self.opened: list[tuple[str, str]] = []
        self.open_refusal = ""
        self.watched: dict[str, asyncio.Queue[MigrationEvent]] = {}

    def watch(self, migration_id: str) -> asyncio.Queue[MigrationEvent]:
        return self.watched.setdefault(migration_id, asyncio.Queue())

    def unwatch(self, migration_id: str) -> None:
        self.watched.pop(migration_id, None)

    async def open_channel(self, backend: str, migration_id: str) -> KVChannel:
        if self.open_refusal:
            raise EngineCommandRefused(self.open_refusal)
        self.opened.append((backend, migration_id))
        return KVChannel(backend=backend, channel_id=f"{migration_id}-c", store_address="127.0.0.1:7")

    async def drop_staging(self, migration_id: str) -> None:
        self.dropped.append(migration_id)
        self.changed.set()

    async def wait_dropped(self, expected: list[str]) -> None:
        """The destination drops staging without waiting for the engine: wait for the command."""
        async with asyncio.timeout(5):
            while self.dropped != expected:
                self.changed.clear()
                await self.changed.wait()


class HungLink(FakeLink):
    """An engine that died: its commands are never answered (the real link times out after seconds)."""

    async def drop_staging(self, migration_id: str) -> None:
        await asyncio.Event().wait()


@pytest_asyncio.fixture
async def destination() -> AsyncIterator[tuple[Destination, FakeLink]]:
    requests = RequestTable()
    tracker = LoadTracker("d", requests)
    tracker.on_snapshot(EngineSnapshot(engine_id="e", step=1, timestamp=time.time(), total_blocks=100,
                                       free_blocks=100, block_size=16))
    metrics = LlumletMetrics("d", tracker.report)
    admission = Admission(EngineClient("http://127.0.0.1:9"), requests, tracker, metrics)
    admission.engine_healthy = True
    link = FakeLink()
    node = Destination("d", admission, tracker, link, lambda: dict(HANDSHAKE),  # type: ignore[arg-type]
                       MigrationSettings(max_concurrent=2, lease_s=0.3), metrics)
    yield node, link
    await admission.engine.close()


def _proposal(migration_id: str, blocks: int, **handshake: object) -> mpb.ProposeMigrationRequest:
    return mpb.ProposeMigrationRequest(
        migration_id=migration_id, source_instance_id="s", request_id=f"req-{migration_id}",
        body_json=json.dumps({"prompt": "x", "max_tokens": 10}), prompt_tokens=blocks * 16 - 1,
        output_tokens=1, blocks=blocks, handshake_json=json.dumps({**HANDSHAKE, **handshake}), lease_ms=300)


def _load(node: Destination) -> tuple[int, int]:
    report = node.tracker.report()
    assert report is not None
    return report.load.reserved_blocks, report.load.migrating_in


async def test_accepting_reserves_blocks_in_the_load_until_aborted(destination: tuple) -> None:
    node, link = destination
    answer = await node.propose(_proposal("m1", 10))
    assert answer.accepted and answer.kv_address == "tcp://127.0.0.1:9" and answer.transport == "tcp"
    # The key its engine's receiver requires of this migration's frames, and of no other's.
    assert answer.kv_key == migration_key(str(HANDSHAKE["kv_secret"]), "m1") != migration_key(
        str(HANDSHAKE["kv_secret"]), "m2")
    assert _load(node) == (11, 1)  # one block of growth while it keeps decoding
    released = node.abort(mpb.AbortMigrationRequest(migration_id="m1", reason="test"))
    assert released.released and _load(node) == (0, 0)
    await link.wait_dropped(["m1"])
    assert not node.abort(mpb.AbortMigrationRequest(migration_id="m1")).released


async def test_abort_answers_at_once_when_the_engine_does_not(destination: tuple) -> None:
    node, _ = destination
    node.link = HungLink()
    assert (await node.propose(_proposal("m1", 10))).accepted
    assert node.abort(mpb.AbortMigrationRequest(migration_id="m1", reason="test")).released
    assert _load(node) == (0, 0)
    await node.close()  # the hung command is cancelled, not left behind


async def test_refusals_change_nothing(destination: tuple) -> None:
    node, _ = destination
    incompatible = await node.propose(_proposal("m1", 4, block_size=32))
    assert not incompatible.accepted and "block_size" in incompatible.reason
    too_big = await node.propose(_proposal("m2", 98))  # fits, but leaves freeness below the threshold
    assert not too_big.accepted and "room" in too_big.reason
    node.tracker.draining = True
    draining = await node.propose(_proposal("m3", 4))
    assert not draining.accepted and "draining" in draining.reason
    assert _load(node) == (0, 0)


async def test_the_answer_carries_the_negotiated_channel_and_its_rendezvous(destination: tuple) -> None:
    node, link = destination
    tcp = await node.propose(_proposal("m1", 4))  # both on auto, CPU engines: the CPU default
    assert tcp.accepted and tcp.transport == "tcp" and not tcp.HasField("channel") and link.opened == []
    gloo = await node.propose(mpb.ProposeMigrationRequest(transport="gloo", **_fields(_proposal("m2", 4))))
    assert gloo.accepted and gloo.transport == "gloo" and link.opened == [("gloo", "m2")]
    assert gloo.channel == KVChannel(backend="gloo", channel_id="m2-c", store_address="127.0.0.1:7")
    assert gloo.kv_address == "tcp://127.0.0.1:9"


async def test_a_channel_mismatch_is_refused_with_its_reason_and_changes_nothing(destination: tuple) -> None:
    node, link = destination
    nccl = await node.propose(mpb.ProposeMigrationRequest(transport="nccl", **_fields(_proposal("m1", 4))))
    assert not nccl.accepted and "needs a CUDA GPU on both engines" in nccl.reason
    node.settings = replace(node.settings, transport="tcp")
    gloo = await node.propose(mpb.ProposeMigrationRequest(transport="gloo", **_fields(_proposal("m2", 4))))
    assert not gloo.accepted and "over gloo only, the destination over tcp only" in gloo.reason
    no_gloo = await node.propose(_proposal("m3", 4, kv_channels=["tcp"]))
    assert no_gloo.accepted and no_gloo.transport == "tcp"  # tcp is set here, and every engine has it
    node.settings = replace(node.settings, transport="gloo")
    refused = await node.propose(_proposal("m4", 4, kv_channels=["tcp"]))
    assert not refused.accepted and "the source engine has only tcp" in refused.reason
    assert _load(node) == (5, 1) and link.opened == []  # only m3 holds blocks


async def test_an_engine_that_cannot_open_the_channel_is_a_refusal_that_releases_the_blocks(
        destination: tuple) -> None:
    node, link = destination
    node.settings = replace(node.settings, transport="gloo")
    link.open_refusal = "this torch has no gloo backend"
    refused = await node.propose(_proposal("m1", 4))
    assert not refused.accepted and "could not open a gloo channel: this torch has no gloo" in refused.reason
    assert _load(node) == (0, 0) and node.reservations == {}


def _fields(proposal: mpb.ProposeMigrationRequest) -> dict[str, object]:
    return {field.name: value for field, value in proposal.ListFields()}


async def test_concurrency_bound_counts_migrations_in_and_out(destination: tuple) -> None:
    node, _ = destination
    assert (await node.propose(_proposal("m1", 4))).accepted
    node.outgoing = lambda: 1
    busy = await node.propose(_proposal("m2", 4))
    assert not busy.accepted and "2 migration" in busy.reason
    duplicate = await node.propose(_proposal("m1", 4))
    assert not duplicate.accepted


class _Clock:
    """Stands in for the destination module's `time`: its monotonic clock moves only when the test moves
    it, so a lease lasts exactly as long as the test says however slowly the machine runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


async def test_leases_expire_unless_renewed(destination: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    node, link = destination
    clock = _Clock()
    monkeypatch.setattr(destination_module, "time", clock)
    lease = node.settings.lease_s
    kept = mpb.RenewMigrationRequest(migration_id="kept")
    lost = mpb.RenewMigrationRequest(migration_id="lost")
    assert (await node.propose(_proposal("kept", 4))).accepted
    assert (await node.propose(_proposal("lost", 4))).accepted
    proposed = clock.now
    expiry = asyncio.create_task(node.expire())
    try:
        clock.now = proposed + lease / 2
        assert node.renew(kept).ok
        clock.now = proposed + lease * 1.25  # "lost" is past due; the renewed "kept" has a quarter left
        await link.wait_dropped(["lost"])
        assert not node.renew(lost).ok
        assert _load(node) == (5, 1)
        clock.now += lease * 2  # renewals stop: "kept" runs out too
        await link.wait_dropped(["lost", "kept"])
        assert not node.renew(kept).ok
        assert _load(node) == (0, 0)
    finally:
        expiry.cancel()
        await asyncio.gather(expiry, return_exceptions=True)


async def test_commit_without_a_reservation_fails(destination: tuple) -> None:
    node, _ = destination
    answer = await node.commit(mpb.CommitMigrationRequest(migration_id="nope"))
    assert not answer.ok and "no such migration" in answer.reason

    assert node.attach("nope") is None


async def test_a_request_moving_out_is_marked_in_the_load(destination: tuple) -> None:
    node, _ = destination
    node.tracker.on_snapshot(EngineSnapshot(
        engine_id="e", step=2, timestamp=time.time(), total_blocks=100, free_blocks=90, block_size=16,
        running=[EngineRequest(request_id="x", prompt_tokens=100, output_tokens=5, blocks=7),
                 EngineRequest(request_id="y", prompt_tokens=10, output_tokens=5, blocks=1)]))
    node.tracker.migrating_out.add("x")
    report = node.tracker.report()
    assert report is not None
    assert report.load.migrating_out == 1
    assert {r.request_id: r.migrating for r in report.load.running} == {"x": True, "y": False}


class SlowEngine(EngineClient):
    """An engine slow to its first token: its stream breaks (the request is over either way) only once
    the test sets `answer`, so the commit is still waiting for as long as the test needs it to."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.answer = asyncio.Event()

    async def open_stream(self, endpoint: object, body: object) -> aiohttp.ClientResponse:
        await self.answer.wait()
        raise EngineUnavailableError("no first token")


async def _committing(node: Destination) -> asyncio.Task[mpb.CommitMigrationResponse]:
    """Migration "m1" proposed and its Commit under way, once the resumed request runs in the engine."""
    proposal = _proposal("m1", 4)
    proposal.endpoint = pb.ENDPOINT_COMPLETION
    assert (await node.propose(proposal)).accepted
    commit = asyncio.create_task(node.commit(mpb.CommitMigrationRequest(
        migration_id="m1", prompt_token_ids=list(range(63)), generated_token_ids=[1], staged_tokens=63)))
    await wait_until(lambda: node.admission.running("req-m1"), "the resumed request running")
    return commit


async def test_abort_after_an_interrupted_commit_stops_the_copy_and_drops_the_staging(
        destination: tuple) -> None:
    node, link = destination
    engine = node.admission.engine = SlowEngine("http://127.0.0.1:9")
    commit = await _committing(node)
    assert not commit.done()
    commit.cancel()  # the source's Commit deadline passed
    await asyncio.gather(commit, return_exceptions=True)
    answer = node.abort(mpb.AbortMigrationRequest(migration_id="m1", reason="commit timed out"))
    assert answer.released and _load(node) == (0, 0)
    await link.wait_dropped(["m1"])
    engine.answer.set()  # the abort takes effect once the engine answers the stream's opening
    await wait_until(lambda: not node.admission.running("req-m1"), "the resumed request stopped")
    assert node.attach("req-m1") is None


async def _slow_engine(first_token: asyncio.Event) -> web.AppRunner:
    """An OpenAI-style engine whose streams send their first token once `first_token` is set, then one
    token a step until the client goes away (only an abort ends them)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await first_token.wait()
        for token in itertools.count():
            chunk = {"id": "x", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": "t", "token_ids": [token], "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.05)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_a_first_token_slower_than_the_lease_is_kept_for_the_caller_to_attach(
        destination: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    node, link = destination
    clock = _Clock()
    monkeypatch.setattr(destination_module, "time", clock)
    lease = node.settings.lease_s
    first_token = asyncio.Event()
    runner = await _slow_engine(first_token)
    port = runner.addresses[0][1]
    node.admission.engine = EngineClient(f"http://127.0.0.1:{port}")
    expiry = asyncio.create_task(node.expire())
    try:
        # Proposed alongside and never committed: its expiry shows a sweep ran past the lease.
        assert (await node.propose(_proposal("witness", 4))).accepted
        commit = await _committing(node)
        clock.now += lease * 2  # the first token is slower than the lease
        await wait_until(lambda: "witness" in link.dropped, "a sweep expiring the witness's lease")
        assert link.dropped == ["witness"], "the committing migration was released as expired"
        assert not commit.done() and node.admission.running("req-m1")
        first_token.set()
        answer = await commit
        assert answer.ok, answer.reason
        assert node.admission.running("req-m1")  # not aborted as unattached while it had no token
        # The caller never attaches: its lease runs out after the answer.
        clock.now += lease * 2
        await wait_until(lambda: not node.admission.running("req-m1"), "the unattached request aborted")
        assert node.attach("req-m1") is None
    finally:
        expiry.cancel()
        await asyncio.gather(expiry, return_exceptions=True)
        first_token.set()  # a stream still waiting for it then ends with its client
        await node.admission.engine.close()
        await runner.cleanup()


@pytest.mark.parametrize("loaded", [True, False])
async def test_commit_answers_how_the_first_tokens_wait_split_at_the_engines_load(
        destination: tuple, monkeypatch: pytest.MonkeyPatch, loaded: bool) -> None:
    node, link = destination
    clock = _Clock()
    monkeypatch.setattr(destination_module, "time", clock)
    first_token = asyncio.Event()
    runner = await _slow_engine(first_token)
    node.admission.engine = EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        commit = await _committing(node)
        if loaded:  # the engine loaded the staged KV 30 ms after Commit arrived, in 5 ms
            link.watched["m1"].put_nowait(MigrationEvent(
                kind=MIGRATION_EVENT_KIND_LOADED, migration_id="m1", copy_ms=5.0,
                timestamp=clock.now + 0.035))
        clock.now += 0.050
        first_token.set()
        answer = await commit
        assert answer.ok, answer.reason
        assert answer.first_token_ms == pytest.approx(50.0)
        if loaded:
            assert (answer.admitted_ms, answer.kv_load_ms) == (pytest.approx(30.0), 5.0)
        else:  # not seen by the first token: not split, never guessed
            assert (answer.admitted_ms, answer.kv_load_ms) == (0.0, 0.0)
        assert "m1" not in link.watched
    finally:
        first_token.set()
        await node.admission.engine.close()
        await runner.cleanup()


def test_a_threshold_above_the_policys_destination_bound_raises_it() -> None:
    assert MigrationSettings().policy.destination_freeness == 10.0  # the policy's (scale-up) bound
    assert MigrationSettings(freeness_threshold=1e9).policy.destination_freeness == 1e9  # "full"
