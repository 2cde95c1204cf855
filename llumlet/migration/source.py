"""The source side of a migration (MigrateOut): pick the request, Propose it to the destination, send
KV stages while it keeps decoding, then the final stage: the engine keeps its blocks (ExportFinal),
the llumlet stops its stream, the rest is sent, and Commit starts it on the destination. Before the
final stage every failure leaves the request running here; after it the request is resumed here by
recompute unless the destination committed. The caller's stream ends with `Moved` on success."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NoReturn

import grpc

from llumlet.admission import Admission, MovedTo, Suspension
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.downtime import downtime_parts
from llumlet.migration.engine_link import EngineCommandRefused, EngineLink
from llumlet.migration.rules import (
    answer_refusal,
    engine_channels,
    migration_refusal,
    resume_point,
    usable_staged_tokens,
)
from llumlet.migration.settings import MigrationSettings
from llumlet.requests import RequestRecord
from llumnix.engine.handshake import public_record
from llumnix.llumlet_client import llumlet_channel
from llumnix.load import blocks_for_tokens
from llumnix.policies.migration import select_request
from llumnix.service_token import ServiceToken, call_metadata
from llumnix.v1 import llumlet_pb2
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGE_FAILED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    MigrationEvent,
)
from llumnix.v1.migration_pb2_grpc import LlumletMigrationStub
from llumnix.wire import endpoint_to_proto

logger = logging.getLogger("llumlet.migration")

SELECT_NAMES = {mpb.MIGRATION_SELECT_LAST_COME: "last-come", mpb.MIGRATION_SELECT_SHORTEST: "shortest",
                mpb.MIGRATION_SELECT_LONGEST: "longest"}
_POLL_S = 0.05
_FINISH_GRACE_S = 1.0


class MigrationFailed(Exception):
    """Ends a migration with this outcome and reason."""

    def __init__(self, outcome: int, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


@dataclass(slots=True)
class _Progress:
    migration_id: str
    record: RequestRecord
    destination: LlumletMigrationStub
    destination_address: str
    started: float = field(default_factory=time.monotonic)
    stages: int = 0
    staged_tokens: int = 0
    bytes: int = 0
    proposed: bool = False
    renewed: float = 0.0
    """When the destination's lease was last renewed (Propose starts it)."""
    stages_ms: float = 0.0
    """Time in the live stages: each from its export command to its STAGE_SENT event."""
    send_ms: float = 0.0
    """Of that, sending the stages' frames to the destination engine (until its acknowledgement)."""
    downtime_ms: float = 0.0
    final_stage_ms: float = 0.0
    """Downtime until the final stage was sent (the engine's abort, the last blocks' copy and send)."""
    final_stage_kv_ms: float = 0.0
    """Of final_stage_ms, the engine's copy and send of the last blocks."""
    final_stage_event_ms: float = 0.0
    """Of final_stage_ms, the final STAGE_SENT event's way from the engine to this llumlet."""
    commit_ms: float = 0.0
    """Downtime in Commit (the destination's admission, KV load and first step)."""
    destination_first_token_ms: float = 0.0
    """Of commit_ms, the destination's own measure: Commit received -> its first token."""
    destination_admitted_ms: float = 0.0
    destination_kv_load_ms: float = 0.0
    """Of destination_first_token_ms: until its engine began loading the staged KV, and the load."""
    transport: str = ""
    """The KV channel the destination chose."""


class PeerStubs:
    """One channel per peer llumlet; every call carries `metadata` (the service token)."""

    def __init__(self, token: ServiceToken | None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metadata = call_metadata(token)

    def stub(self, address: str) -> LlumletMigrationStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = llumlet_channel(address)
        return LlumletMigrationStub(channel)

    def connected(self, address: str) -> bool:
        """Whether the channel to `address` holds a connection: it leaves READY as soon as the peer's
        process dies (its kernel closes the connection), without a call."""
        channel = self._channels.get(address)
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class Source:
    def __init__(self, instance_id: str, address: str, admission: Admission, tracker: LoadTracker,
                 link: EngineLink, handshake: Callable[[], dict[str, object] | None],
                 settings: MigrationSettings, metrics: LlumletMetrics, incoming: Callable[[], int],
                 token: ServiceToken | None) -> None:
        self.instance_id = instance_id
        self.address = address
        self.admission = admission
        self.tracker = tracker
        self.link = link
        self.handshake = handshake
        self.settings = settings
        self.metrics = metrics
        self.incoming = incoming
        self.peers = PeerStubs(token)
        self.active: set[str] = set()

    # ----- choosing

    def _choose(self, request: mpb.MigrateOutRequest) -> RequestRecord:
        if len(self.active) + self.incoming() >= self.settings.max_concurrent:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_BUSY,
                                  f"this instance already takes part in {self.settings.max_concurrent} "
                                  "migration(s)")
        if request.request_id:
            record = self.admission.requests.get(request.request_id)
            if record is None or not self.admission.running(request.request_id):
                raise MigrationFailed(mpb.MIGRATION_OUTCOME_NO_CANDIDATE,
                                      f"no request {request.request_id!r} is running here")
            if request.request_id in self.tracker.migrating_out:
                raise MigrationFailed(mpb.MIGRATION_OUTCOME_NO_CANDIDATE, "the request is already migrating")
            refusal = migration_refusal(record)
            if refusal is not None:
                raise MigrationFailed(mpb.MIGRATION_OUTCOME_NO_CANDIDATE, refusal)
            return record
        report = self.tracker.report()
        if report is None:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_NO_CANDIDATE, "this instance has no load yet")
        records = {r.request_id: r for r in self.admission.requests if self.admission.running(r.request_id)}
        movable = tuple(r for r in report.load.running if r.request_id in records
                        and migration_refusal(records[r.request_id]) is None)
        policy = SELECT_NAMES.get(request.select, self.settings.select)
        chosen = select_request(replace(report.load, running=movable), policy)
        if chosen is None:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_NO_CANDIDATE, "no running request can migrate")
        return records[chosen.request_id]

    def _block_size(self) -> int:
        report = self.tracker.report()
        if report is None or not report.load.block_size:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED, "this instance lost its load")
        return report.load.block_size

    # ----- the migration

    async def migrate_out(self, request: mpb.MigrateOutRequest) -> mpb.MigrateOutResponse:
        try:
            record = self._choose(request)
        except MigrationFailed as exc:
            self.metrics.migrations.labels("out", mpb.MigrationOutcome.Name(exc.outcome)).inc()
            logger.info("migration out not started", extra={
                "request_id": request.request_id, "outcome": mpb.MigrationOutcome.Name(exc.outcome),
                "reason": exc.reason, "destination": request.destination_instance_id})
            return mpb.MigrateOutResponse(outcome=exc.outcome, request_id=request.request_id,
                                          reason=exc.reason)
        progress = _Progress(f"{self.instance_id}-{uuid.uuid4().hex[:12]}", record,
                             self.peers.stub(request.destination_address), request.destination_address)
        self.active.add(progress.migration_id)
        self.tracker.migrating_out.add(record.request_id)
        self.tracker.notify()
        events = self.link.watch(progress.migration_id)
        outcome, reason = mpb.MIGRATION_OUTCOME_COMMITTED, ""
        try:
            await self._run(progress, request, events)
        except MigrationFailed as exc:
            outcome, reason = exc.outcome, exc.reason
        finally:
            self.link.unwatch(progress.migration_id)
            self.active.discard(progress.migration_id)
            self.tracker.migrating_out.discard(record.request_id)
            self.tracker.notify()
        duration_s = time.monotonic() - progress.started
        name = mpb.MigrationOutcome.Name(outcome)
        self.metrics.migrations.labels("out", name).inc()
        self.metrics.migration_duration.labels(name).observe(duration_s)
        self.metrics.migration_stages.inc(progress.stages)
        self.metrics.migration_bytes.inc(progress.bytes)
        answer = mpb.MigrateOutResponse(
            outcome=outcome, migration_id=progress.migration_id, request_id=record.request_id, reason=reason,
            stages=progress.stages, bytes=progress.bytes, migrated_tokens=progress.staged_tokens,
            downtime_ms=progress.downtime_ms, duration_ms=duration_s * 1e3, transport=progress.transport,
            final_stage_ms=progress.final_stage_ms, final_stage_kv_ms=progress.final_stage_kv_ms,
            final_stage_event_ms=progress.final_stage_event_ms, commit_ms=progress.commit_ms,
            destination_first_token_ms=progress.destination_first_token_ms,
            destination_admitted_ms=progress.destination_admitted_ms,
            destination_kv_load_ms=progress.destination_kv_load_ms)
        if outcome == mpb.MIGRATION_OUTCOME_COMMITTED:
            self.metrics.migration_downtime.observe(progress.downtime_ms / 1e3)
            for part, ms in downtime_parts(answer).items():
                self.metrics.migration_downtime_part.labels(part).observe(max(0.0, ms) / 1e3)
        log = logger.info if outcome in (mpb.MIGRATION_OUTCOME_COMMITTED,
                                         mpb.MIGRATION_OUTCOME_REFUSED) else logger.warning
        log("migration out ended", extra={
            "migration_id": progress.migration_id, "request_id": record.request_id, "outcome": name,
            "reason": reason, "destination": request.destination_instance_id, "transport": progress.transport,
            "stages": progress.stages,
            "bytes": progress.bytes, "staged_tokens": progress.staged_tokens,
            "downtime_ms": round(progress.downtime_ms, 2),
            "final_stage_ms": round(progress.final_stage_ms, 2),
            "final_stage_kv_ms": round(progress.final_stage_kv_ms, 2),
            "final_stage_event_ms": round(progress.final_stage_event_ms, 2),
            "commit_ms": round(progress.commit_ms, 2),
            "destination_first_token_ms": round(progress.destination_first_token_ms, 2),
            "destination_admitted_ms": round(progress.destination_admitted_ms, 2),
            "destination_kv_load_ms": round(progress.destination_kv_load_ms, 2),
            "stages_ms": round(progress.stages_ms, 2),
            "send_ms": round(progress.send_ms, 2), "duration_ms": round(duration_s * 1e3, 2)})
        return answer

    async def _run(self, progress: _Progress, request: mpb.MigrateOutRequest,
                   events: asyncio.Queue[MigrationEvent]) -> None:
        answer = await self._propose(progress)
        try:
            await self._stages(progress, answer, events)
            await self._export(progress, answer, final=True)
        except MigrationFailed:
            await self._abandon(progress, "aborted before the final stage")
            raise
        suspension = self.admission.suspend(progress.record.request_id)
        stopped_at = time.monotonic()
        if suspension is None or not await suspension.stopped:
            await self._abandon(progress, "the request finished on the source")
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE,
                                  "the request finished here while it was migrating")
        try:
            await self._final(progress, request, events, suspension, stopped_at)
        except MigrationFailed as exc:
            await self._abandon(progress, exc.reason)
            self._resume_here(progress, suspension)
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_RESUMED_ON_SOURCE,
                                  f"{exc.reason}; the request resumed here by recompute") from None
        except BaseException:
            self._resume_here(progress, suspension)
            raise
        finally:
            progress.downtime_ms = (time.monotonic() - stopped_at) * 1e3

    async def _propose(self, progress: _Progress) -> mpb.ProposeMigrationResponse:
        record = progress.record
        handshake = self.handshake()
        if handshake is None:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_REFUSED,
                                  "this engine has not published its handshake record yet")
        tokens = len(record.prompt_token_ids) + record.output_tokens
        proposal = mpb.ProposeMigrationRequest(
            migration_id=progress.migration_id, source_instance_id=self.instance_id,
            source_address=self.address, request_id=record.request_id,
            endpoint=endpoint_to_proto(record.endpoint), body_json=json.dumps(record.body),
            priority=llumlet_pb2.PRIORITY_HIGH if record.high_priority else llumlet_pb2.PRIORITY_NORMAL,
            prompt_tokens=len(record.prompt_token_ids), output_tokens=record.output_tokens,
            blocks=blocks_for_tokens(tokens, self._block_size()),
            handshake_json=json.dumps(public_record(handshake)),  # its KV secret stays here
            lease_ms=int(self.settings.lease_s * 1000), transport=self.settings.transport)
        try:
            answer = await progress.destination.Propose(proposal, timeout=self.settings.peer_timeout_s,
                                                         metadata=self.peers.metadata)
        except grpc.aio.AioRpcError as exc:
            reason = f"the destination did not answer: {exc.code().name} {exc.details()}"
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_REFUSED, reason) from None
        if not answer.accepted:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_REFUSED, f"the destination refused: {answer.reason}")
        progress.proposed = True
        progress.renewed = time.monotonic()
        progress.transport = answer.transport or "tcp"
        refusal = answer_refusal(self.settings.transport, engine_channels(handshake),
                                 answer.transport or "tcp", answer.channel.backend)
        if refusal is not None:
            await self._abandon(progress, refusal)
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_REFUSED, refusal)
        return answer

    def _blocks_left(self, progress: _Progress) -> int:
        """Blocks not yet sent in full (the partial tail block is always sent again). The engine runs
        ahead of this llumlet's view of the request; it has at least one token more than it staged
        (the last sampled token has no KV yet), so at least one block is always left."""
        block_size = self._block_size()
        record = progress.record
        tokens = max(len(record.prompt_token_ids) + record.output_tokens, progress.staged_tokens + 1)
        return blocks_for_tokens(tokens, block_size) - progress.staged_tokens // block_size

    async def _stages(self, progress: _Progress, answer: mpb.ProposeMigrationResponse,
                      events: asyncio.Queue[MigrationEvent]) -> None:
        while (progress.stages < self.settings.max_stages
               and self._blocks_left(progress) > self.settings.final_delta_blocks):
            asked = time.monotonic()
            await self._export(progress, answer, final=False)
            event = await self._stage_sent(progress, events, final=False)
            progress.stages_ms += (time.monotonic() - asked) * 1e3
            progress.send_ms += event.send_ms
            progress.stages += 1
            progress.staged_tokens = max(progress.staged_tokens, event.num_tokens)
            progress.bytes += event.bytes
            # A stage the destination engine acknowledged shows it alive; its llumlet's lease needs
            # renewing only now and then, not one more round trip per stage, or at once when the
            # connection to that llumlet dropped (its process died: the Renew fails now, not a quarter
            # of a lease later).
            if (time.monotonic() - progress.renewed < answer.lease_ms / 4000
                    and self.peers.connected(progress.destination_address)):
                continue
            progress.renewed = time.monotonic()
            try:
                renewed = await progress.destination.Renew(
                    mpb.RenewMigrationRequest(migration_id=progress.migration_id, stages=progress.stages,
                                              staged_tokens=progress.staged_tokens),
                    timeout=self.settings.peer_timeout_s, metadata=self.peers.metadata)
            except grpc.aio.AioRpcError as exc:
                raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED,
                                      f"the destination is gone: {exc.code().name}") from None
            if not renewed.ok:
                raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED,
                                      f"the destination dropped the migration: {renewed.reason}")

    async def _export(self, progress: _Progress, answer: mpb.ProposeMigrationResponse, final: bool) -> None:
        self._check_running(progress)
        try:
            await self.link.export_stage(progress.migration_id, progress.record.request_id, answer.kv_address,
                                         answer.transport, answer.channel, answer.kv_key, final)
        except EngineCommandRefused as exc:
            await self._fail(progress, f"the engine refused the export: {exc}")

    async def _fail(self, progress: _Progress, reason: str) -> NoReturn:
        """Ends the migration: FINISHED_ON_SOURCE if the request is ending here (the engine refuses or
        fails a stage of a finished request, and says so before the llumlet sees the request's last
        chunk), ABORTED with `reason` otherwise."""
        if await self._finishing(progress):
            self._check_running(progress)
        raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED, reason)

    async def _finishing(self, progress: _Progress) -> bool:
        """Whether the request is ending here, within a short grace: the engine can fail a stage of a
        request it has just finished before this llumlet reads the request's last chunk. An engine
        snapshot taken after the failure that still lists the request as running settles it at once
        (a dead destination is not waited on for the whole grace)."""
        failed_at = time.time()
        deadline = time.monotonic() + _FINISH_GRACE_S
        request_id = progress.record.request_id
        while time.monotonic() < deadline:
            if progress.record.finish_reasons or not self.admission.running(request_id):
                return True
            if self.tracker.engine_runs(request_id, since=failed_at):
                return False
            await asyncio.sleep(_POLL_S / 5)
        return False

    def _check_running(self, progress: _Progress) -> None:
        record = progress.record
        if record.finish_reasons or not self.admission.running(record.request_id):
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_FINISHED_ON_SOURCE,
                                  "the request finished here while it was migrating")

    async def _stage_sent(self, progress: _Progress, events: asyncio.Queue[MigrationEvent],
                          final: bool) -> MigrationEvent:
        deadline = time.monotonic() + self.settings.stage_timeout_s
        while time.monotonic() < deadline:
            if not final:
                self._check_running(progress)
            try:
                event = await asyncio.wait_for(events.get(), _POLL_S)
            except TimeoutError:
                continue
            if event.kind == MIGRATION_EVENT_KIND_STAGE_FAILED:
                if final:
                    raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED, f"a KV stage failed: {event.error}")
                await self._fail(progress, f"a KV stage failed: {event.error}")
            if event.kind == MIGRATION_EVENT_KIND_STAGE_SENT and event.final == final:
                return event
        raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED,
                              f"no KV stage was sent within {self.settings.stage_timeout_s:g} s")

    async def _final(self, progress: _Progress, request: mpb.MigrateOutRequest,
                     events: asyncio.Queue[MigrationEvent], suspension: Suspension,
                     stopped_at: float) -> None:
        event = await self._stage_sent(progress, events, final=True)
        sent_at = time.monotonic()
        progress.final_stage_ms = (sent_at - stopped_at) * 1e3
        progress.final_stage_kv_ms = event.copy_ms + event.send_ms
        # The engine stamps the event with the wall clock; it runs beside this llumlet (one pod).
        progress.final_stage_event_ms = max(0.0, (time.time() - event.timestamp) * 1e3)
        progress.stages += 1
        progress.bytes += event.bytes
        record = progress.record
        progress.staged_tokens = usable_staged_tokens(max(progress.staged_tokens, event.num_tokens), record)
        try:
            committed = await progress.destination.Commit(
                mpb.CommitMigrationRequest(
                    migration_id=progress.migration_id, prompt_token_ids=record.prompt_token_ids,
                    generated_token_ids=record.generated_token_ids.get(0, []),
                    staged_tokens=progress.staged_tokens),
                timeout=self.settings.commit_timeout_s, metadata=self.peers.metadata)
        except grpc.aio.AioRpcError as exc:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED,
                                  f"the commit failed: {exc.code().name} {exc.details()}") from None
        progress.commit_ms = (time.monotonic() - sent_at) * 1e3
        progress.destination_first_token_ms = committed.first_token_ms
        progress.destination_admitted_ms = committed.admitted_ms
        progress.destination_kv_load_ms = committed.kv_load_ms
        if not committed.ok:
            raise MigrationFailed(mpb.MIGRATION_OUTCOME_ABORTED,
                                  f"the destination failed: {committed.reason}")
        suspension.decide(MovedTo(request.destination_instance_id, request.destination_address,
                                  record.request_id, progress.migration_id))

    def _resume_here(self, progress: _Progress, suspension: Suspension) -> None:
        suspension.decide(resume_point(progress.record))

    async def _abandon(self, progress: _Progress, reason: str) -> None:
        """Nothing of a failed migration may outlive it: the engine forgets the export and the
        destination releases its reservation and staging (its lease expires if it is unreachable)."""
        await self.link.cancel_export(progress.migration_id)
        if progress.proposed:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await progress.destination.Abort(
                    mpb.AbortMigrationRequest(migration_id=progress.migration_id, reason=reason),
                    timeout=self.settings.peer_timeout_s, metadata=self.peers.metadata)

    async def close(self) -> None:
        await self.peers.close()
