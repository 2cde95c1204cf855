"""The requests the service's routers hold (`llumnix.held_demand`), read before each autoscaling
decision and each migration pass: a router holds requests while every instance is busy, and held
ones are in no instance's load, so without them a burst the routers absorb would look like a service
with room to spare, and migration would fill the room a held request waits for."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

from llumnix.held_demand import HELD_DEMAND_PATH, held_demand_from_bytes
from llumnix.service_token import ServiceToken

logger = logging.getLogger("llumnix.control")

READ_TIMEOUT_S = 1.0
"""The decision does not wait longer for a router."""
STALE_S = 10.0
"""A router that did not answer in time counts its last answer if it is at most this old: a router
too busy to answer is the one most likely holding requests (seen under a CPU hog). One that refuses
the connection (gone) or the read counts nothing."""
LISTING_TTL_S = 5.0
"""How long a listing of the routers is reused: the migration pass reads the held requests every
migration interval (100 ms by default), and the operator lists router pods through the Kubernetes API.
A router that started since is counted at most this late."""


class RouterQueues:
    """`addresses()`: the routers' base URLs now (`http://host:port`; the operator lists router pods,
    local mode has one). Every read presents `token`."""

    def __init__(self, addresses: Callable[[], Awaitable[Sequence[str]]], token: ServiceToken | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._addresses = addresses
        self._headers = {"Authorization": token.authorization} if token is not None else {}
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[str] = set()
        """Routers whose last read failed (logged once until they answer again)."""
        self._answers: dict[str, tuple[float, list[int]]] = {}
        """Router -> when it last answered, and what."""
        self._listing: tuple[float, Sequence[str]] | None = None
        """When the routers were last listed, and the addresses."""

    async def held_tokens(self) -> list[int]:
        """Every router's held requests (the tokens each needs). A router that does not answer in time
        adds its last answer while that is recent (`STALE_S`), one that cannot be read adds none."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S))
        now = self._clock()
        if self._listing is None or now - self._listing[0] >= LISTING_TTL_S:
            try:
                self._listing = (now, await self._addresses())
            except Exception as exc:  # the API server's hiccup must not hold up the decision
                logger.warning("cannot list the routers; counting no held request",
                               extra={"error": str(exc) or type(exc).__name__})
                return []
        addresses = self._listing[1]
        for gone in self._answers.keys() - set(addresses):
            del self._answers[gone]
        held: list[int] = []
        for tokens in await asyncio.gather(*(self._read(address) for address in addresses)):
            held.extend(tokens)
        return held

    async def _read(self, address: str) -> list[int]:
        assert self._session is not None
        try:
            url = address.rstrip("/") + HELD_DEMAND_PATH
            async with self._session.get(url, headers=self._headers) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                tokens = held_demand_from_bytes(await response.read())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            answered, last = self._answers.get(address, (None, []))
            # Too slow to answer, rather than gone or refusing: its queue is still there.
            recent = (isinstance(exc, TimeoutError) and answered is not None
                      and self._clock() - answered <= STALE_S)
            if address not in self._failing:
                self._failing.add(address)
                logger.warning("cannot read the requests a router holds; counting "
                               + ("its last answer while it is recent" if recent else "none"),
                               extra={"router": address, "error": str(exc) or type(exc).__name__})
            return last if recent else []
        self._failing.discard(address)
        self._answers[address] = (self._clock(), tokens)
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
