"""The router's view of its instances: per llumlet a connection with its live load
(`llumnix.llumlet_client.LlumletConnection`) and the router's own in-flight accounting.

Router state is rebuilt from the load streams only, so router replicas need no state sync. Between
two loads the router adds the requests it dispatched that the instance does not list yet
(`llumnix.load.with_pending`), so a burst does not herd onto the instance that looked freest."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from llumnix.llumlet_client import LlumletConnection
from llumnix.load import InstanceLoad, RequestLoad, with_pending, without_requests
from llumnix.prefix_cache import PrefixIndex
from llumnix.router.instance_source import InstanceSource
from llumnix.router.serve_session import ServeSession
from llumnix.service_token import ServiceToken
from llumnix.wire import LoadReport

logger = logging.getLogger("llumnix.router.instances")

UNAVAILABLE_COOLDOWN_S = 2.0
"""After an instance refused or failed a request as unavailable, skip it this long (its load
stream may still look healthy: the llumlet is up, its engine is not)."""


class Instance(LlumletConnection):
    """One llumlet as the router sees it."""

    def __init__(self, address: str, on_change: Callable[[], None],
                 on_load_change: Callable[[Instance], None] = lambda _instance: None, *,
                 token: ServiceToken | None = None, prefix_index: PrefixIndex | None = None) -> None:
        super().__init__(address, on_change, token=token)
        self.prefix_index = prefix_index
        """Where the prefix-cache changes of this instance's load stream go."""
        self.serve = ServeSession(self.stub, self.call_metadata)
        """The data path: every request the router runs here travels on this one stream."""
        self._on_load_change = on_load_change
        """Runs whenever `effective_load()` or `is_idle()` may have changed."""
        self.pending: dict[str, RequestLoad] = {}
        """Dispatched here and not yet listed in the instance's load."""
        self.in_flight: set[str] = set()
        self.ended: set[str] = set()
        """Released here and still listed in the instance's load (its next load will drop them)."""
        self.unavailable_until = -float("inf")
        self._effective: InstanceLoad | None = None
        """`effective_load()` until the load or the pending requests change."""

    def has_engine_load(self) -> bool:
        """Whether the latest load is the engine's: until its engine first reports, a llumlet sends a
        placeholder with no memory and no block size, against which nothing can be dispatched."""
        return self.report is not None and self.report.load.block_size > 0

    def dispatchable(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return not self.removed and self.connected(now) and self.has_engine_load() \
            and now >= self.unavailable_until

    def mark_unavailable(self) -> None:
        self.unavailable_until = time.monotonic() + UNAVAILABLE_COOLDOWN_S

    def mark_available(self) -> None:
        self.unavailable_until = -float("inf")

    async def close(self) -> None:
        await self.serve.close()
        await super().close()

    def effective_load(self) -> InstanceLoad:
        """The latest load plus the requests dispatched here that it does not list yet, minus the
        requests that ended here since."""
        assert self.report is not None
        if self._effective is None:
            current = without_requests(self.report.load, self.ended)
            self._effective = with_pending(current, tuple(self.pending.values()))
        return self._effective

    def is_idle(self) -> bool:
        return self.report is not None and self.effective_load().num_requests == 0 and not self.in_flight

    def reserve(self, request: RequestLoad) -> None:
        self.pending[request.request_id] = request
        self.in_flight.add(request.request_id)
        self._effective = None
        self._on_load_change(self)

    def release(self, request_id: str) -> None:
        """The request left this instance (finished, moved, failed or cancelled)."""
        if self.pending.pop(request_id, None) is None and self.report is not None and \
                request_id in _listed(self.report.load):
            self.ended.add(request_id)
        self._effective = None
        self.in_flight.discard(request_id)
        self._on_load_change(self)
        self._on_change()

    def _observed(self, report: LoadReport) -> None:
        changes = report.prefix_changes
        if changes is not None and self.prefix_index is not None:
            self.prefix_index.apply(report.load.instance_id, changes.stored, changes.removed, changes.full)
        self._effective = None
        if self.pending or self.ended:
            listed = _listed(report.load)
            for request_id in listed.intersection(self.pending):
                del self.pending[request_id]
            self.ended &= listed
        self._on_load_change(self)


def _listed(load: InstanceLoad) -> set[str]:
    return {r.request_id for r in load.running} | {r.request_id for r in load.waiting}


class InstanceSet:
    """Every instance of the service, kept in step with an `InstanceSource`; `on_change` runs after
    every load update, release and membership change (the dispatch queue retries then)."""

    def __init__(self, source: InstanceSource | None = None, on_change: Callable[[], None] = lambda: None,
                 token: ServiceToken | None = None) -> None:
        """`token`: the service token every llumlet requires."""
        self.source = source
        self.token = token
        self.on_change = on_change
        self._by_address: dict[str, Instance] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._load_listeners: list[Callable[[Instance], None]] = []
        self.changed = asyncio.Event()
        self.prefix_index = PrefixIndex()
        """Every instance's prefix cache, from the load streams (prefix-aware dispatch)."""

    def all(self) -> list[Instance]:
        return list(self._by_address.values())

    def __len__(self) -> int:
        return len(self._by_address)

    def _notify(self) -> None:
        self.changed.set()
        self.on_change()

    def on_load_change(self, listener: Callable[[Instance], None]) -> None:
        """Call `listener(instance)` whenever an instance's effective load may have changed (a load
        arrived, a request was reserved or released there) and when it is removed."""
        self._load_listeners.append(listener)

    def _load_changed(self, instance: Instance) -> None:
        for listener in self._load_listeners:
            listener(instance)

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
            instance = self._by_address[address] = Instance(address, self._notify, self._load_changed,
                                                                  token=self.token,
                                                                  prefix_index=self.prefix_index)
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
            self.prefix_index.drop(instance.instance_id)
            self._load_changed(instance)
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
