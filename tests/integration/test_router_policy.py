"""The llumnix dispatch policy against round-robin through the real router, llumlets and sim engines,
in real time: a skewed (power-law) workload on a few instances with small KV caches. Round-robin
sends requests to instances whose memory is taken by long requests, where they queue; llumnix
sends them where there is room, so its P99 time to first token is lower."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from service_auth import SERVICE_TOKEN
from waiting import wait_until

from llumnix.bench import BenchConfig, run_bench
from llumnix.launch.pair import EnginePair
from llumnix.router.api import ApiSettings
from llumnix.router.instance_source import ListInstanceSource
from llumnix.router.server import Router, RouterConfig
from llumnix.traces import generate_trace

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

MODEL = "sim"
INSTANCES = 4
# 64 blocks of 16 tokens (the profile's block size): a few long requests fill an instance.
ENGINE = {"num_blocks": 64, "block_size": 16, "max_model_len": 1000, "engine_args": ("--time-scale", "2")}
StartPairs = Callable[..., Awaitable[list[EnginePair]]]
TRACE = generate_trace("S-S", num_requests=80, rate=5.0, seed=0, max_total_tokens=600)


async def p99_ttft(addresses: list[str], policy: str) -> tuple[float, int]:
    config = RouterConfig(api=ApiSettings(model=MODEL), host="127.0.0.1", port=0, dispatch_policy=policy,
                          service_token=SERVICE_TOKEN)
    router = Router(config, ListInstanceSource(addresses))
    await router.start()
    try:
        await wait_until(lambda: len(router.instances.dispatchable()) == len(addresses),
                         f"all {len(addresses)} instances dispatchable", timeout_s=60)
        result = await run_bench(BenchConfig(url=router.url, model=MODEL, show_progress=False), TRACE)
    finally:
        await router.shutdown()
    summary = result.summary()
    return float(summary["prefill_p99"]), int(summary["errors"])


async def test_llumnix_beats_round_robin_on_p99_time_to_first_token(sim_pairs: StartPairs) -> None:
    addresses = [p.grpc_address for p in await sim_pairs(INSTANCES, "p", **ENGINE)]
    llumnix, llumnix_errors = await p99_ttft(addresses, "llumnix")
    round_robin, round_robin_errors = await p99_ttft(addresses, "round-robin")
    assert llumnix_errors == round_robin_errors == 0
    assert llumnix < round_robin, (llumnix, round_robin)
