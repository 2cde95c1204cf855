"""Fixtures shared by the router's integration tests: sim engine + llumlet pairs (processes) and
routers in front of them. The llumlets require the service token (service_auth.py), as in a deployment;
the routers present it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from service_auth import SERVICE_TOKEN
from waiting import wait_until

from llumnix.launch.pair import EnginePair, PairConfig
from llumnix.router.api import ApiSettings
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router, RouterConfig

SIM_MODEL = "sim"

StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim_pairs(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StartPairs]:
    """`await sim_pairs(count, prefix, **PairConfig fields)`: sim engine + llumlet pairs named
    `<prefix>-<i>` serving model "sim", requiring `SERVICE_TOKEN`, started together; all are stopped
    when the module ends."""
    started: list[EnginePair] = []

    async def start(count: int, prefix: str, **config: Any) -> list[EnginePair]:
        work = tmp_path_factory.mktemp(prefix)
        config.setdefault("service_token", SERVICE_TOKEN)
        pairs = [EnginePair(PairConfig(instance_id=f"{prefix}-{i}", work_dir=work / str(i), engine="sim",
                                       served_model_name=SIM_MODEL, **config))
                 for i in range(count)]
        started.extend(pairs)
        await asyncio.gather(*(p.start() for p in pairs))
        return pairs

    yield start
    await asyncio.gather(*(p.stop() for p in started), return_exceptions=True)


@pytest_asyncio.fixture(loop_scope="module")
async def start_router() -> AsyncIterator[StartRouter]:
    """`await start_router(addresses, **RouterConfig fields)`: a router on a free port over those
    llumlets (presenting `SERVICE_TOKEN`), returned once every load stream is up; shut down when the
    test ends."""
    routers: list[Router] = []

    async def start(addresses: list[str], **overrides: Any) -> Router:
        api = overrides.pop("api", ApiSettings(model=SIM_MODEL))
        overrides.setdefault("service_token", SERVICE_TOKEN)
        router = Router(RouterConfig(api=api, host="127.0.0.1", port=0, **overrides),
                        ListInstanceSource(addresses))
        routers.append(router)
        await router.start()
        await wait_until(lambda: len(router.instances.dispatchable()) == len(addresses),
                         f"the router's load streams from {addresses}")
        return router

    yield start
    for router in routers:
        await router.shutdown()
