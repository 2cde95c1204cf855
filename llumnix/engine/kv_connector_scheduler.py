"""The connector's scheduler side: tracks requests by `kv_transfer_params["llumlet_id"]` (vLLM rewrites
the request ids the API server sees), answers the llumlet's migration commands
(llumnix/engine/engine_channel.py) and plans stages (llumnix/engine/kv_migration_plan.py): ExportStage
copies a running request's new blocks after the next step, ExportFinal keeps a finishing request's
blocks (delayed free) until the rest is copied out. A migrated-in request
(`kv_transfer_params["llumlet_migration_id"]`, `"llumlet_staged_tokens"`) reports its staged tokens as
already computed, so only the last token is recomputed. Each step's load goes to `LoadTelemetry`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from llumnix.engine.engine_channel import EngineCommandServer
from llumnix.engine.kv_migration_plan import ExportItem, LoadItem, MigrationPlan
from llumnix.engine.kv_transport_pair import ChannelRendezvous

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from llumnix.engine.engine_telemetry import LoadTelemetry

logger = init_logger("vllm.llumnix")


def llumlet_id(request: Request) -> str:
    """The llumlet's id for a request; the engine's own id when no llumlet tagged it."""
    return (request.kv_transfer_params or {}).get("llumlet_id") or request.request_id


def staged_load_end(params: dict[str, Any], num_tokens: int) -> int:
    """Tokens of a migrated-in request whose KV comes from staging: all staged ones but at most
    `num_tokens - 1`, because the last token must run through the model to give the next logits."""
    if not params.get("llumlet_migration_id"):
        return 0
    return max(0, min(int(params.get("llumlet_staged_tokens") or 0), num_tokens - 1))


@dataclasses.dataclass
class LlumnixConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    exports: list[ExportItem] = dataclasses.field(default_factory=list)
    loads: list[LoadItem] = dataclasses.field(default_factory=list)
    drops: list[str] = dataclasses.field(default_factory=list)


class ConnectorScheduler:
    """`telemetry`: where each step's load goes (None: not published). `command_address`: where the
    llumlet's migration commands arrive (None: the engine serves without migration). `rendezvous`
    opens the pair channels the llumlet asks for as a destination (OpenChannel)."""

    def __init__(self, block_size: int, telemetry: LoadTelemetry | None, command_address: str | None,
                 rendezvous: ChannelRendezvous | None = None) -> None:
        self._requests: dict[str, tuple[str, Request]] = {}  # engine request id -> (llumlet id, request)
        self._telemetry = telemetry
        self._manager: KVCacheManager | None = None
        self._drops: collections.deque[str] = collections.deque()  # DropStaging, for the worker
        self._rendezvous = rendezvous
        self._plan = MigrationPlan(block_size, self._drops.append,
                                   rendezvous.open if rendezvous is not None else None)
        self._pending_exports: list[ExportItem] = []
        self._pending_loads: dict[str, LoadItem] = {}  # engine request id -> load, until scheduled
        self._loaded: set[str] = set()  # engine request ids whose staging was already used
        self._commands: EngineCommandServer | None = None
        if command_address:
            self._commands = EngineCommandServer(command_address, self._plan.handle)
            logger.info("llumnix connector: migration commands on %s", command_address)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._manager = kv_cache_manager
        if self._telemetry is not None:
            self._telemetry.bind(kv_cache_manager, self._requests)

    def on_new_request(self, request: Request) -> None:
        key = llumlet_id(request)
        self._requests[request.request_id] = (key, request)
        self._plan.track(key, request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._loaded:
            return 0, False  # preempted after its load: staging is gone, recompute
        end = staged_load_end(request.kv_transfer_params or {}, request.num_tokens)
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params or {}
        end = staged_load_end(params, request.num_tokens)
        # Block ids are filled in when the request is scheduled (build_connector_meta).
        self._pending_loads[request.request_id] = LoadItem(
            migration_id=params["llumlet_migration_id"],
            request_id=llumlet_id(request),
            engine_request_id=request.request_id,
            start_token=end - num_external_tokens,
            end_token=end,
            block_ids=(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LlumnixConnectorMetadata:
        if self._telemetry is not None:
            self._telemetry.step(scheduler_output)
        meta = LlumnixConnectorMetadata(exports=self._pending_exports)
        self._pending_exports = []
        scheduled = scheduler_output.num_scheduled_tokens

        def running(engine_id: str) -> tuple[list[int], int] | None:
            if engine_id not in scheduled or engine_id not in self._requests or self._manager is None:
                return None
            request = self._requests[engine_id][1]
            # KV valid once this step's forward ran: computed so far + scheduled now.
            valid = request.num_computed_tokens + scheduled[engine_id]
            return list(self._manager.get_block_ids(engine_id)[0]), valid

        meta.exports.extend(self._plan.take_stages(running))
        for new_request in scheduler_output.scheduled_new_reqs:
            load = self._pending_loads.pop(new_request.req_id, None)
            if load is not None:
                meta.loads.append(dataclasses.replace(load, block_ids=tuple(new_request.block_ids[0])))
                self._loaded.add(new_request.req_id)
        while self._drops:
            meta.drops.append(self._drops.popleft())
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key, _ = self._requests.pop(request.request_id, (llumlet_id(request), request))
        self._pending_loads.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        final = self._plan.final_export(key, request.request_id, block_ids, request.num_computed_tokens)
        if final is None:
            return False, None
        self._pending_exports.append(final)
        logger.info("llumnix migration %s: final stage of %s queued (%d tokens, %d blocks)",
                    final.migration_id, key, final.num_tokens, len(final.block_ids))
        return True, {"llumlet_migration_id": final.migration_id, "llumlet_final_tokens": final.num_tokens}

    def close(self) -> None:
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        if self._rendezvous is not None:
            self._rendezvous.close()
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None
