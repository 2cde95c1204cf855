"""The destination side of a migration: Propose reserves blocks for a lease (shown in the load as
reserved_blocks / migrating_in), Renew extends it, Commit starts the request from its resume point
through the llumlet's own admission path with the staged KV, and keeps its output until the caller
attaches (Generate attach=true). Expired leases release the reservation and drop the staging."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llumlet.admission import Admission, AdmissionError, StreamEvent
from llumlet.load_tracker import LoadTracker
from llumlet.metrics import LlumletMetrics
from llumlet.migration.engine_link import EngineCommandRefused, EngineLink
from llumlet.migration.rules import choose_channel, engine_channels, resume_point
from llumlet.migration.settings import MigrationSettings
from llumlet.requests import RequestRecord
from llumnix.engine.handshake import KV_SECRET_FIELD, incompatibilities, migration_key
from llumnix.load import RequestLoad
from llumnix.openai_replay import NotReplayable
from llumnix.policies.migration import admits
from llumnix.v1 import llumlet_pb2
from llumnix.v1 import migration_pb2 as mpb
from llumnix.v1.kv_transfer_pb2 import MIGRATION_EVENT_KIND_LOADED, MigrationEvent
from llumnix.wire import endpoint_from_proto

logger = logging.getLogger("llumlet.migration")

_EXPIRY_INTERVAL_S = 0.25


@dataclass(slots=True)
class Reservation:
    migration_id: str
    request_id: str
    source_instance_id: str
    proposal: mpb.ProposeMigrationRequest
    blocks: int
    deadline: float


@dataclass(slots=True)
class MigratedStream:
    """A migrated-in request's output, buffered until its caller attaches."""

    request_id: str
    migration_id: str
    deadline: float
    """Until when it waits for its caller to attach (from Commit's answer on)."""
    queue: asyncio.Queue[StreamEvent | AdmissionError | None] = field(default_factory=asyncio.Queue)
    attached: bool = False

    async def events(self) -> AsyncIterator[StreamEvent]:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, AdmissionError):
                raise item
            yield item


class Destination:
    def __init__(self, instance_id: str, admission: Admission, tracker: LoadTracker, link: EngineLink,
                 handshake: Callable[[], dict[str, object] | None], settings: MigrationSettings,
                 metrics: LlumletMetrics) -> None:
        self.instance_id = instance_id
        self.admission = admission
        self.tracker = tracker
        self.link = link
        self.handshake = handshake
        self.settings = settings
        self.metrics = metrics
        self.reservations: dict[str, Reservation] = {}
        self.streams: dict[str, MigratedStream] = {}
        self.outgoing: Callable[[], int] = lambda: 0
        """Migrations out in progress here (set by the source side; they share the concurrency bound)."""
        self._tasks: set[asyncio.Task[None]] = set()

    # ----- reservations

    def _refusal(self, request: mpb.ProposeMigrationRequest) -> tuple[str, str | None]:
        """(the KV channel, None) when this instance takes the request, else ("", why not)."""
        refusal = self.admission.refusal()
        if refusal is not None:
            return "", str(refusal)
        if self.tracker.requests.get(request.request_id) is not None:
            return "", f"request id {request.request_id!r} is already running here"
        if request.migration_id in self.reservations:
            return "", f"migration {request.migration_id!r} is already proposed here"
        if len(self.reservations) + self.outgoing() >= self.settings.max_concurrent:
            return "", f"this instance already takes part in {self.settings.max_concurrent} migration(s)"
        mine = self.handshake()
        if mine is None or not mine.get("kv_address") or not mine.get(KV_SECRET_FIELD):
            return "", "this engine has not published its handshake record (KV receiver) yet"
        try:
            peer = json.loads(request.handshake_json)
        except ValueError:
            return "", "the source's handshake record is not JSON"
        problems = incompatibilities(mine, peer)
        if problems:
            return "", "incompatible engines: " + "; ".join(problems)
        channel, refusal = choose_channel(request.transport, self.settings.transport, engine_channels(peer),
                                          engine_channels(mine))
        if refusal is not None:
            return "", refusal
        report = self.tracker.report()
        if report is None:
            return "", "this instance has not observed its engine yet"
        candidate = RequestLoad(request.request_id, request.prompt_tokens, request.output_tokens,
                                request.blocks)
        if not admits(candidate, report.load, self.settings.policy):
            return "", (f"not enough room: {report.load.free_blocks - report.load.reserved_blocks} free "
                        f"blocks, the request holds {request.blocks} and freeness must stay >= "
                        f"{self.settings.policy.destination_freeness:g}")
        return channel, None

    def _refuse(self, request: mpb.ProposeMigrationRequest, reason: str) -> mpb.ProposeMigrationResponse:
        logger.info("migration refused", extra={"migration_id": request.migration_id,
                                                "request_id": request.request_id, "reason": reason})
        self.metrics.migrations.labels("in", "refused").inc()
        return mpb.ProposeMigrationResponse(accepted=False, reason=reason)

    async def propose(self, request: mpb.ProposeMigrationRequest) -> mpb.ProposeMigrationResponse:
        """Accepts (reserving blocks, and for a pair channel opening its rendezvous in this engine) or
        refuses with the reason."""
        transport, refusal = self._refusal(request)
        if refusal is not None:
            return self._refuse(request, refusal)
        blocks = request.blocks + 1  # it keeps decoding while it moves
        # Reserved before the engine opens the channel, so a concurrent Propose sees the bound.
        self.reservations[request.migration_id] = Reservation(
            request.migration_id, request.request_id, request.source_instance_id, request, blocks,
            time.monotonic() + self.settings.lease_s)
        self._publish_reservations()
        answer = mpb.ProposeMigrationResponse(accepted=True, transport=transport,
                                              lease_ms=int(self.settings.lease_s * 1000))
        if transport != "tcp":
            try:
                answer.channel.CopyFrom(await self.link.open_channel(transport, request.migration_id))
            except EngineCommandRefused as exc:
                if self.reservations.pop(request.migration_id, None) is not None:
                    self._publish_reservations()
                return self._refuse(request, f"this engine could not open a {transport} channel: {exc}")
        mine = self.handshake() or {}
        answer.kv_address = str(mine["kv_address"])
        # The receiver takes this migration's frames only with its key; it goes to the source alone.
        answer.kv_key = migration_key(str(mine[KV_SECRET_FIELD]), request.migration_id)
        logger.info("migration accepted", extra={"migration_id": request.migration_id,
                                                 "request_id": request.request_id, "blocks": blocks,
                                                 "source": request.source_instance_id,
                                                 "transport": transport})
        return answer

    def renew(self, request: mpb.RenewMigrationRequest) -> mpb.RenewMigrationResponse:
        reservation = self.reservations.get(request.migration_id)
        if reservation is None:
            return mpb.RenewMigrationResponse(ok=False, reason="no such migration here (expired?)")
        reservation.deadline = time.monotonic() + self.settings.lease_s
        return mpb.RenewMigrationResponse(ok=True)

    def abort(self, request: mpb.AbortMigrationRequest) -> mpb.AbortMigrationResponse:
        # A source that gave up on a slow Commit resumes the request itself: stop the copy here.
        started = next((s for s in self.streams.values() if s.migration_id == request.migration_id), None)
        if started is not None:
            self.detach(started)
            # The interrupted Commit released the reservation; the staging may not have been loaded yet.
            self._drop_staging(request.migration_id)
        released = self._release(request.migration_id, f"aborted by the source: {request.reason}")
        return mpb.AbortMigrationResponse(released=released or started is not None)

    def _drop_staging(self, migration_id: str) -> None:
        """Tells the engine to drop a migration's staging without waiting for its answer: a dead engine
        answers only after the command timeout, and Abort must answer at once (the engine's own staging
        lease frees what a lost command leaves)."""
        task = asyncio.create_task(self.link.drop_staging(migration_id), name=f"drop-{migration_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, migration_id: str, why: str) -> bool:
        """Drops a reservation that will not be committed, and its staging."""
        reservation = self.reservations.pop(migration_id, None)
        if reservation is None:
            return False
        self._publish_reservations()
        self._drop_staging(migration_id)
        self.metrics.migrations.labels("in", "released").inc()
        logger.info("migration released", extra={"migration_id": migration_id,
                                                 "request_id": reservation.request_id, "reason": why})
        return True

    def _publish_reservations(self) -> None:
        self.tracker.migrating_in = len(self.reservations)
        self.tracker.reserved_blocks = sum(r.blocks for r in self.reservations.values())
        self.tracker.notify()

    # ----- commit

    async def commit(self, request: mpb.CommitMigrationRequest
                     ) -> mpb.CommitMigrationResponse:
        started, started_wall = time.monotonic(), time.time()
        reservation = self.reservations.get(request.migration_id)
        if reservation is None:
            return mpb.CommitMigrationResponse(ok=False, reason="no such migration here (expired?)")
        proposal = reservation.proposal
        reservation.deadline = math.inf  # committing: the request's first token ends the reservation
        try:
            record, stream = self._start(reservation, request)
        except (ValueError, NotReplayable) as exc:
            self._release(request.migration_id, f"cannot resume: {exc}")
            return mpb.CommitMigrationResponse(ok=False, reason=f"cannot resume the request: {exc}")
        events = self.link.watch(request.migration_id)
        first = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._pump(record, stream, first), name=f"migrated-{record.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            ok, reason = await first
        finally:
            # The request now holds its own blocks (or failed): the reservation has served.
            self.reservations.pop(request.migration_id, None)
            self._publish_reservations()
            self.link.unwatch(request.migration_id)
        if not ok:
            self.streams.pop(record.request_id, None)
            self._drop_staging(request.migration_id)
            self.metrics.migrations.labels("in", "failed").inc()
            return mpb.CommitMigrationResponse(ok=False, reason=reason)
        answer = mpb.CommitMigrationResponse(ok=True, first_token_ms=(time.monotonic() - started) * 1e3)
        _time_the_load(answer, events, started_wall)
        # The caller learns of the move only from this answer: its time to attach starts now.
        stream.deadline = time.monotonic() + self.settings.lease_s
        self.metrics.migrations.labels("in", "committed").inc()
        logger.info("migration committed", extra={
            "migration_id": request.migration_id, "request_id": proposal.request_id,
            "staged_tokens": request.staged_tokens, "first_token_ms": round(answer.first_token_ms, 2),
            "admitted_ms": round(answer.admitted_ms, 2), "kv_load_ms": round(answer.kv_load_ms, 2)})
        return answer

    def _start(self, reservation: Reservation, request: mpb.CommitMigrationRequest
               ) -> tuple[RequestRecord, MigratedStream]:
        proposal = reservation.proposal
        body = json.loads(proposal.body_json)
        record = RequestRecord(
            proposal.request_id, endpoint_from_proto(proposal.endpoint), body,
            high_priority=proposal.priority == llumlet_pb2.PRIORITY_HIGH,
            prompt_token_ids=tuple(request.prompt_token_ids),
            generated_token_ids={0: list(request.generated_token_ids)}, migratable=True)
        record.resume = resume_point(record, {"llumlet_migration_id": request.migration_id,
                                              "llumlet_staged_tokens": request.staged_tokens})
        stream = MigratedStream(record.request_id, request.migration_id, deadline=math.inf)
        self.streams[record.request_id] = stream
        return record, stream

    async def _pump(self, record: RequestRecord, stream: MigratedStream,
                    first: asyncio.Future[tuple[bool, str]]) -> None:
        """Runs the resumed request, buffering its events for the attached caller."""
        try:
            async with contextlib.aclosing(self.admission.run(record)) as events:
                async for event in events:
                    if not first.done() and (event.moved or any(c.token_ids or c.finish_reason
                                                                for c in event.chunks)):
                        first.set_result((True, ""))
                    stream.queue.put_nowait(event)
        except AdmissionError as exc:
            if not first.done():
                first.set_result((False, f"the destination engine failed the request: {exc}"))
            stream.queue.put_nowait(exc)
        finally:
            if not first.done():
                first.set_result((False, "the destination engine ended the request without output"))
            stream.queue.put_nowait(None)

    def attach(self, request_id: str) -> MigratedStream | None:
        """The migrated-in request's output for its caller (once)."""
        stream = self.streams.get(request_id)
        if stream is None or stream.attached:
            return None
        stream.attached = True
        return stream

    def detach(self, stream: MigratedStream) -> None:
        """The attached caller is done (or gone: the request is aborted)."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
        self.admission.abort(stream.request_id)

    # ----- leases

    async def expire(self) -> None:
        """Releases reservations and unattached outputs whose lease ran out (runs until cancelled)."""
        while True:
            await asyncio.sleep(_EXPIRY_INTERVAL_S)
            now = time.monotonic()
            for migration_id in [m for m, r in self.reservations.items() if r.deadline <= now]:
                self._release(migration_id, "lease expired")
            for stream in [s for s in self.streams.values() if not s.attached and s.deadline <= now]:
                logger.warning("migrated request never attached; aborting it",
                               extra={"request_id": stream.request_id})
                self.detach(stream)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _time_the_load(answer: mpb.CommitMigrationResponse, events: asyncio.Queue[MigrationEvent],
                   received_wall: float) -> None:
    """Splits the first token's wait by the engine's LOADED event, if it has arrived (the engine
    stamps it with the wall clock; it runs beside this llumlet)."""
    while not events.empty():
        event = events.get_nowait()
        if event.kind == MIGRATION_EVENT_KIND_LOADED:
            answer.kv_load_ms = event.copy_ms
            answer.admitted_ms = max(0.0, (event.timestamp - received_wall) * 1e3 - event.copy_ms)
