"""The connector's worker-side migration machinery without vLLM: stages copied out of one paged cache
are sent by the sender thread to a destination's staging service and written into another cache, over
tcp and over a gloo pair channel (the path NCCL takes on GPUs)."""

import time

import pytest
import torch
from waiting import wait_until_sync

from llumnix.engine.handshake import migration_key
from llumnix.engine.kv_blocks import KVBlockCopier
from llumnix.engine.kv_migration_plan import Destination, ExportItem
from llumnix.engine.kv_migration_worker import StageSender, StagingService, transfer_payload
from llumnix.engine.kv_transport_pair import ChannelRendezvous
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGE_FAILED,
    MIGRATION_EVENT_KIND_STAGE_RECEIVED,
    MIGRATION_EVENT_KIND_STAGE_SENT,
    MIGRATION_EVENT_KIND_STAGING_HELD,
    MigrationEvent,
    OpenChannel,
)


def _cache(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn((16, 2, 4, 8), generator=generator) for i in range(2)}


def _wait(events: list[MigrationEvent], count: int) -> None:
    """Until `count` events of migrations (the staging's STAGING_HELD reports, which come on every
    change and every second, not counted)."""
    wait_until_sync(lambda: sum(e.kind != MIGRATION_EVENT_KIND_STAGING_HELD for e in events) >= count,
                    f"{count} migration events")


def _held(events: list[MigrationEvent]) -> tuple[int, int, int] | None:
    """The newest STAGING_HELD report: (migrations, blocks, bytes)."""
    held = [e for e in events if e.kind == MIGRATION_EVENT_KIND_STAGING_HELD]
    return (held[-1].migrations, held[-1].blocks, held[-1].bytes) if held else None


@pytest.fixture
def rendezvous():
    """The destination engine's side of OpenChannel (it keeps a gloo channel's store serving)."""
    opened = ChannelRendezvous("127.0.0.1", lease_s=60, timeout_s=5)
    yield opened
    opened.close()


def _destination(rendezvous: ChannelRendezvous, address: str, transport: str) -> Destination:
    """Where stages go; a pair channel's rendezvous is opened the way the destination engine does it."""
    if transport == "tcp":
        return Destination(address, "tcp")
    channel = rendezvous.open(OpenChannel(backend=transport, migration_id="m"))
    return Destination(address, transport, channel, channel.channel_id)


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_stages_travel_from_one_cache_into_another(rendezvous, transport: str) -> None:
    source = KVBlockCopier(_cache(1), 16)
    target = KVBlockCopier(_cache(2), 16)
    layout = source.layout
    events: list[MigrationEvent] = []
    staging = StagingService("127.0.0.1", 0, layout.bytes_per_block, layout.dtype, 60, events.append,
                             device=torch.device("cpu"))
    staging.start()
    assert staging.channels == ["tcp", "gloo"]
    sender = StageSender(layout.bytes_per_block, layout.dtype, events.append, timeout_s=5)
    destination = _destination(rendezvous, staging.address, transport)
    request_blocks = (3, 7, 9)
    try:
        for stage, first, blocks, tokens, final in ((1, 0, (3, 7), 6, False), (2, 1, (7, 9), 10, True)):
            item = ExportItem("m", "r", "engine-r", stage, final, first, blocks, tokens, destination,
                              migration_key(staging.kv_secret, "m"))
            sender.submit(item, source.copy_out_block_major(blocks), copy_ms=0.5)
        _wait(events, 4)
    finally:
        sender.close()
    sent = [e for e in events if e.kind == MIGRATION_EVENT_KIND_STAGE_SENT]
    received = [e for e in events if e.kind == MIGRATION_EVENT_KIND_STAGE_RECEIVED]
    assert [(e.stage, e.final, e.blocks, e.num_tokens) for e in sent] == [(1, False, 2, 6), (2, True, 2, 10)]
    assert all(e.send_ms > 0 and e.copy_ms == 0.5 and e.bytes == 2 * layout.bytes_per_block for e in sent)
    assert [e.num_tokens for e in received] == [6, 10]
    # Blocks 0-1, then 1-2 (the tail block re-sent): staging holds 3 blocks until loaded.
    assert _held(events) == (1, 3, 3 * layout.bytes_per_block)

    staged = staging.take("m")
    assert _held(events) == (0, 0, 0)
    staging.close()
    assert staged is not None and staged.num_tokens == 10
    destination_blocks = [12, 0, 5]
    target.copy_in_parts(destination_blocks, staged.parts(0, 3))  # bytes over tcp, CPU tensors over gloo
    assert torch.equal(target.copy_out(destination_blocks), source.copy_out(request_blocks))


def test_a_dead_destination_becomes_a_stage_failed_event() -> None:
    copier = KVBlockCopier(_cache(1), 16)
    events: list[MigrationEvent] = []
    sender = StageSender(copier.layout.bytes_per_block, copier.layout.dtype, events.append, timeout_s=1)
    item = ExportItem("m", "r", "engine-r", 1, False, 0, (1,), 3, Destination("tcp://127.0.0.1:1", "tcp"),
                      b"")
    sender.submit(item, copier.copy_out_block_major((1,)), copy_ms=0.1)
    _wait(events, 1)
    sender.close()
    assert events[0].kind == MIGRATION_EVENT_KIND_STAGE_FAILED and "cannot connect" in events[0].error


def test_staging_leases_expire_without_engine_steps() -> None:
    events: list[MigrationEvent] = []
    staging = StagingService("127.0.0.1", 0, 64, "float32", 0.2, events.append)
    staging.start()
    try:
        from llumnix.v1.kv_transfer_pb2 import KVStageHeader

        staging.store.put(KVStageHeader(schema_version=1, migration_id="idle", num_blocks=1, num_tokens=3,
                                        payload_bytes=64, bytes_per_block=64, dtype="float32"), b"x" * 64)
        wait_until_sync(lambda: not staging.store.staged_tokens("idle"),
                        "the reaper to expire the idle staging")
        assert staging.store.bytes_held == 0
        wait_until_sync(lambda: _held(events) == (0, 0, 0), "the expiry's STAGING_HELD report")
        assert (1, 1, 64) in [(e.migrations, e.blocks, e.bytes) for e in events]
    finally:
        staging.close()


def test_block_major_buffers_hold_each_block_contiguously() -> None:
    # Two kernel blocks per scheduler block: block b spans kernel blocks 2b and 2b+1.
    cache = {f"layer{i}": torch.arange(i * 1000, i * 1000 + 8 * 3, dtype=torch.float32).view(8, 1, 3)
             for i in range(2)}
    copier = KVBlockCopier(cache, 4)
    buffer = copier.copy_out_block_major([2, 0])
    assert buffer.shape == copier.block_major_shape(2) == (2, 2, 2, 1, 3)
    assert buffer[0].flatten().tolist() == [*range(12, 18), *range(1012, 1018)]  # block 2, both layers
    assert torch.equal(buffer.permute(1, 0, 2, 3, 4).reshape(copier.buffer_shape(2)), copier.copy_out([2, 0]))
    target = KVBlockCopier({name: torch.zeros_like(t) for name, t in cache.items()}, 4)
    target.copy_in_block_major([1, 3], buffer)
    assert torch.equal(target.copy_out([1, 3]), copier.copy_out([2, 0]))


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_connector_workers_move_a_final_stage_and_load_it(tmp_path, rendezvous, transport: str) -> None:
    import zmq

    from llumnix.engine.kv_connector_worker import ConnectorWorker
    from llumnix.engine.kv_migration_plan import LoadItem
    from llumnix.v1.kv_transfer_pb2 import MIGRATION_EVENT_KIND_LOAD_FAILED, MIGRATION_EVENT_KIND_LOADED

    block_size = 4
    source_cache, target_cache = _cache(1), _cache(2)
    source, target = ConnectorWorker(block_size), ConnectorWorker(block_size)
    source.register_kv_caches(source_cache, 16)
    target.register_kv_caches(target_cache, 16)
    pulls = {name: zmq.Context.instance().socket(zmq.PULL) for name in ("source", "target")}

    def next_event(name: str, kind: int, timeout_s: float = 30.0) -> MigrationEvent:
        """The next event of `kind` from one worker (its STAGING_HELD reports, every second, and other
        kinds are skipped); fails once `timeout_s` has passed without one."""
        deadline = time.monotonic() + timeout_s
        while (left_ms := int(1e3 * (deadline - time.monotonic()))) > 0 and pulls[name].poll(left_ms):
            event = MigrationEvent.FromString(pulls[name].recv())
            if event.kind == kind:
                return event
        raise AssertionError(f"no event of kind {kind} from the {name} worker in {timeout_s:g} s")

    try:
        for name, worker in (("source", source), ("target", target)):
            worker.start_migration(f"ipc://{tmp_path}/{name}-events", "127.0.0.1", 0,
                                   send_timeout_s=5, staging_lease_s=60)
            pulls[name].connect(f"ipc://{tmp_path}/{name}-events")
            # An event sent before the connection is up is dropped (the publisher never blocks the
            # engine); the first periodic staging report says it is up.
            next_event(name, MIGRATION_EVENT_KIND_STAGING_HELD)
        assert source.kv_channels == ["tcp", "gloo"] and target.kv_address.startswith("tcp://127.0.0.1:")

        destination = _destination(rendezvous, target.kv_address, transport)
        assert target.kv_secret is not None
        final = ExportItem("m", "r", "engine-r", 1, True, 0, (3, 7), 6, destination,
                           migration_key(target.kv_secret, "m"))
        source.copy_exports([final], final=False)  # live stages only: the final one waits
        assert source.take_finished_sending() == set()
        source.copy_exports([final], final=True)
        assert source.take_finished_sending() == {"engine-r"}

        next_event("target", MIGRATION_EVENT_KIND_STAGE_RECEIVED)
        # The last token is recomputed: tokens [0, 5) come from staging, into blocks 12 and 5.
        target.start_load([], [LoadItem("m", "r", "engine-r2", 0, 5, (12, 5))])
        assert next_event("target", MIGRATION_EVENT_KIND_LOADED).num_tokens == 5
        assert target.take_load_errors() == set()
        copier = KVBlockCopier(target_cache, 16)
        assert torch.equal(copier.copy_out([12, 5]), KVBlockCopier(source_cache, 16).copy_out([3, 7]))

        target.start_load([], [LoadItem("gone", "r", "engine-r3", 0, 5, (1, 2))])
        assert "no staging" in next_event("target", MIGRATION_EVENT_KIND_LOAD_FAILED).error
        assert target.take_load_errors() == {1, 2}
    finally:
        for pull in pulls.values():
            pull.close(linger=0)
        source.close()
        target.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_stage_payloads_by_transport(device) -> None:
    """A stage goes out as the buffer's bytes: in host memory for tcp (a memoryview) and gloo (a tensor),
    page-locked when copied off a CUDA cache; on the device for nccl."""
    buffer = torch.arange(24, dtype=torch.float32, device=device).reshape(2, 3, 4)
    expected = buffer.cpu().numpy().tobytes()
    tcp, gloo = transfer_payload(buffer, "tcp"), transfer_payload(buffer, "gloo")
    assert isinstance(tcp, memoryview) and bytes(tcp) == expected
    assert gloo.device.type == "cpu" and bytes(gloo.numpy()) == expected
    assert gloo.is_pinned() == (device == "cuda")
    nccl = transfer_payload(buffer, "nccl")
    assert nccl.device == buffer.device and bytes(nccl.cpu().numpy()) == expected
