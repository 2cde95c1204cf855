"""The router's view of its instances: per llumlet a gRPC channel, a `WatchLoad` subscription that
keeps the latest load (reconnecting with backoff), and the router's own in-flight accounting.

Router state is rebuilt from the load streams only, so router replicas need no state sync. Between
two loads the router adds the requests it dispatched that the instance does not list yet
(`llumnix.load.with_pending`), so a burst does not herd onto the instance that looked freest."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import grpc

from llumnix.load import InstanceLoad, RequestLoad, with_pending
from llumnix.router.instance_source import InstanceSource
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc
from llumnix.wire import LoadReport, report_from_proto

logger = logging.getLogger("llumnix.router.instances")

WATCH_MIN_INTERVAL_MS = 20
WATCH_MAX_INTERVAL_MS = 1000
STALE_AFTER_S = 3.0
"""No load (not even the 1 s heartbeat) for this long: the stream is down, do not dispatch there."""
RECONNECT_BACKOFF_S = (0.1, 2.0)
UNAVAILABLE_COOLDOWN_S = 2.0
"""After an instance refused or failed a request as unavailable, skip it this long (its load
stream may still look healthy: the llumlet is up, its engine is not)."""


class Instance:
    """One llumlet as the router sees it."""

    def __init__(self, address: str, on_change: Callable[[], None]) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = llumlet_pb2_grpc.LlumletStub(self.channel)
        self.report: LoadReport | None = None
        self.last_seen = -float("inf")
        self.pending: dict[str, RequestLoad] = {}
        """Dispatched here and not yet listed in the instance's load."""
        self.in_flight: set[str] = set()
        self.unavailable_until = -float("inf")
        self.removed = False
        self._effective: InstanceLoad | None = None
        """`effective_load()` until the load or the pending requests change (dispatch reads it for
        every instance on every decision)."""
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self.report.load.instance_id if self.report else self.address

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"watch-load {self.address}")

    async def close(self) -> None:
        self.removed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.channel.close(grace=None)

    def connected(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.report is not None and now - self.last_seen < STALE_AFTER_S

    def dispatchable(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return not self.removed and self.connected(now) and now >= self.unavailable_until

    def mark_unavailable(self) -> None:
        self.unavailable_until = time.monotonic() + UNAVAILABLE_COOLDOWN_S

    def mark_available(self) -> None:
        self.unavailable_until = -float("inf")

    def effective_load(self) -> InstanceLoad:
        """The latest load plus the requests dispatched here that it does not list yet."""
        assert self.report is not None
        if self._effective is None:
            self._effective = with_pending(self.report.load, tuple(self.pending.values()))
        return self._effective

    def is_idle(self) -> bool:
        return self.report is not None and self.report.load.num_requests == 0 and not self.in_flight

    def reserve(self, request: RequestLoad) -> None:
        self.pending[request.request_id] = request
        self.in_flight.add(request.request_id)
        self._effective = None

    def release(self, request_id: str) -> None:
        if self.pending.pop(request_id, None) is not None:
            self._effective = None
        self.in_flight.discard(request_id)
        self._on_change()

    def observe(self, report: LoadReport) -> None:
        if self.report is not None and report.sequence <= self.report.sequence \
                and report.load.timestamp <= self.report.load.timestamp:
            return  # reordered or repeated (a restarted llumlet restarts its sequence, with newer time)
        self.report = report
        self._effective = None
        self.last_seen = time.monotonic()
        if self.pending:
            listed = {r.request_id for r in report.load.running} | {r.request_id for r in report.load.waiting}
            for request_id in listed.intersection(self.pending):
                del self.pending[request_id]
        self._on_change()

    async def _watch(self) -> None:
        backoff = RECONNECT_BACKOFF_S[0]
        request = pb.WatchLoadRequest(min_interval_ms=WATCH_MIN_INTERVAL_MS,
                                      max_interval_ms=WATCH_MAX_INTERVAL_MS)
        while not self.removed:
            try:
                async for message in self.stub.WatchLoad(request):
                    first = self.report is None or not self.connected()
                    self.observe(report_from_proto(message))
                    if first:
                        logger.info("instance load stream up",
                                    extra={"address": self.address, "instance_id": self.instance_id})
                    backoff = RECONNECT_BACKOFF_S[0]
            except grpc.aio.AioRpcError as exc:
                if self.connected():
                    logger.warning("instance load stream down", extra={
                        "address": self.address, "instance_id": self.instance_id, "code": exc.code().name})
            except ValueError as exc:  # a load this router cannot read (a newer llumlet's enum value)
                logger.warning("unreadable load; resubscribing", extra={"address": self.address,
                                                                       "reason": str(exc)})
            self.last_seen = -float("inf")
            self._on_change()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])


class InstanceSet:
    """Every instance of the service, kept in step with an `InstanceSource`; `on_change` runs after
    every load update, release and membership change (the dispatch queue retries then)."""

    def __init__(self, source: InstanceSource | None = None, on_change: Callable[[], None] = lambda: None
                 ) -> None:
        self.source = source
        self.on_change = on_change
        self._by_address: dict[str, Instance] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()

    def all(self) -> list[Instance]:
        return list(self._by_address.values())

    def __len__(self) -> int:
        return len(self._by_address)

    def _notify(self) -> None:
        self.changed.set()
        self.on_change()

    def start(self) -> None:
        if self.source is not None:
            self._task = asyncio.create_task(self._follow(self.source), name="instance-source")

    async def _follow(self, source: InstanceSource) -> None:
        async for addresses in source.updates():
            await self.set_addresses(addresses)

    async def set_addresses(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for address in wanted - self._by_address.keys():
            self.add(address)
        for address in set(self._by_address) - wanted:
            await self.remove(address)

    def add(self, address: str, watch: bool = True) -> Instance:
        """`watch=False`: no load subscription; loads come from `Instance.observe` (benchmarks)."""
        instance = self._by_address.get(address)
        if instance is None:
            instance = self._by_address[address] = Instance(address, self._notify)
            if watch:
                instance.start()
            logger.info("instance added", extra={"address": address})
            self._notify()
        return instance

    def get(self, address: str) -> Instance | None:
        return self._by_address.get(address)

    def connection(self, address: str) -> Instance:
        """The instance at `address`, subscribed on first use (a migration destination the source
        has not listed yet)."""
        return self._by_address.get(address) or self.add(address)

    async def remove(self, address: str) -> None:
        instance = self._by_address.pop(address, None)
        if instance is not None:
            # Requests running there keep their stream; the channel closes when they are done.
            instance.removed = True
            logger.info("instance removed", extra={"address": address})
            self._notify()
            task = asyncio.create_task(self._close_when_idle(instance))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_when_idle(instance: Instance, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while instance.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await instance.close()

    def dispatchable(self) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self._by_address.values() if i.dispatchable(now)]

    def counts(self) -> tuple[int, int]:
        """(instances with a live load stream, all instances)."""
        now = time.monotonic()
        return sum(1 for i in self._by_address.values() if i.connected(now)), len(self._by_address)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for instance in list(self._by_address.values()):
            await instance.close()
        self._by_address.clear()
