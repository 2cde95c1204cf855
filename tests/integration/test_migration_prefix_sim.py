"""Migration keeps the prefix-cache report true (sim engines with prefix caching, the real llumlets
and router): a request migrated from A to B is resubmitted on B with its tokens so far, so B caches
its blocks and reports them; the router's index then finds the request's prefix on B, and on A too
(its blocks were freed there and stay cached until evicted)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import grpc
import pytest
from service_auth import authenticated_channel
from waiting import wait_until

from llumnix.launch.pair import EnginePair
from llumnix.prefix_cache import block_hashes
from llumnix.router.server import Router
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.v1 import llumlet_pb2_grpc, migration_pb2_grpc
from llumnix.v1 import migration_pb2 as mpb

pytestmark = [pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

StartPairs = Callable[..., Awaitable[list[EnginePair]]]
StartRouter = Callable[..., Awaitable[Router]]
PROMPT = [(7 * i) % 1000 + 1 for i in range(64)]  # 4 blocks of 16


async def test_a_migrated_requests_blocks_are_reported_by_its_destination(sim_pairs: StartPairs,
                                                                         start_router: StartRouter) -> None:
    a, b = await sim_pairs(2, "prefix-mig", engine_args=("--time-scale", "4", "--enable-prefix-caching"),
                           block_size=16, max_model_len=2048, num_blocks=1000)
    router = await start_router([a.grpc_address, b.grpc_address])
    index = router.instances.prefix_index
    hashes = block_hashes(PROMPT, 16)
    channel = authenticated_channel(a.grpc_address)
    try:
        # Long enough to outlive the waits before its migration.
        body = {"model": "sim", "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True}
        call = llumlet_pb2_grpc.LlumletStub(channel).Generate(pb.GenerateRequest(
            request_id="moving", endpoint=pb.ENDPOINT_COMPLETION, body_json=json.dumps(body)))
        generated: list[int] = []
        while len(generated) <= 16:  # a full generated block, so one moves with the prompt's
            message = await call.read()
            assert message is not grpc.aio.EOF and message.HasField("chunk"), message
            generated += message.chunk.token_ids
        await wait_until(lambda: index.cached_blocks(hashes) == {"prefix-mig-0": 4},
                         "A's report of the request's prompt blocks")
        result = await migration_pb2_grpc.LlumletMigrationStub(channel).MigrateOut(mpb.MigrateOutRequest(
            destination_instance_id=b.config.instance_id, destination_address=b.grpc_address,
            request_id="moving"), timeout=60)
        assert result.outcome == mpb.MIGRATION_OUTCOME_COMMITTED, result.reason
        assert result.migrated_tokens > len(PROMPT) + 16  # a generated block moved too
        await wait_until(lambda: index.cached_blocks(hashes) == {"prefix-mig-0": 4, "prefix-mig-1": 4},
                         "B's report of the migrated request's blocks (and A's of its freed ones)")
        async for message in call:  # what A generated, up to the move
            if message.HasField("moved"):
                break
            generated += message.chunk.token_ids
        moved = block_hashes([*PROMPT, *generated], 16)
        assert len(moved) > 4
        # B holds the generated blocks too (the request's prompt there is its tokens so far).
        await wait_until(lambda: index.cached_blocks(moved).get("prefix-mig-1", 0) == len(moved),
                         "B's report of the generated blocks it received")
    finally:
        await channel.close()
