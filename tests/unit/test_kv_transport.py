"""The engine <-> engine KV data plane over real TCP sockets and threads: frames round-trip into staging,
re-sent tail blocks overwrite, layout mismatches are refused, leases expire, senders reconnect; gloo
pair channels (real torch.distributed point-to-point) through the rendezvous a destination opens, the
code path NCCL takes on GPUs."""

import socket
import threading
import time

import pytest
import torch
from waiting import wait_until_sync

from llumnix.engine.handshake import migration_key, new_kv_secret
from llumnix.engine.kv_staging import StagedKV, StagingStore
from llumnix.engine.kv_transport import (
    KV_FRAME_SCHEMA_VERSION,
    KVTransportError,
    encode_message,
    parse_tcp_address,
    read_ack,
    read_frame,
    write_frame,
)
from llumnix.engine.kv_transport_factory import available_channels, make_receiver, make_sender
from llumnix.engine.kv_transport_pair import ChannelRendezvous, KVStageReceiver, PairKVSender
from llumnix.engine.kv_transport_tcp import TcpKVReceiver, TcpKVSender
from llumnix.v1.kv_transfer_pb2 import (
    MIGRATION_EVENT_KIND_STAGING_HELD,
    KVChannel,
    KVStageAck,
    KVStageHeader,
    MigrationEvent,
    OpenChannel,
)

BLOCK = 64  # bytes per block in these tests
SECRET = new_kv_secret()
"""The test receivers' secret: `_header` carries the key a destination's llumlet would hand out."""


def _header(migration_id: str, stage: int, first: int, blocks: int, tokens: int, **override) -> KVStageHeader:
    fields = dict(
        schema_version=KV_FRAME_SCHEMA_VERSION, migration_id=migration_id, stage=stage, first_block=first,
        num_blocks=blocks, num_tokens=tokens, payload_bytes=blocks * BLOCK, bytes_per_block=BLOCK,
        dtype="float32", kv_key=migration_key(SECRET, migration_id),
    )
    fields.update(override)
    return KVStageHeader(**fields)


def _blocks(*fills: int) -> bytes:
    return b"".join(bytes([fill]) * BLOCK for fill in fills)


def _staged(staged: StagedKV, first: int, last: int) -> bytes:
    """The bytes of staged blocks [first, last), whatever held them (bytes over tcp, tensors otherwise)."""
    return b"".join(bytes(part.cpu().numpy()) if isinstance(part, torch.Tensor) else bytes(part)
                    for part in staged.parts(first, last))


def test_frame_and_ack_round_trip_over_a_socket_pair() -> None:
    left, right = socket.socketpair()
    payload = memoryview(bytearray(_blocks(1, 2, 3)))
    header = _header("m", 1, 0, 3, 70)
    write_frame(left, header, payload)
    frame = read_frame(right)
    assert frame.header == header and bytes(frame.payload) == bytes(payload)
    right.sendall(encode_message(KVStageAck(migration_id="m", stage=1, ok=True)))
    assert read_ack(left).ok
    with pytest.raises(ValueError, match="payload bytes"):
        write_frame(left, _header("m", 2, 0, 2, 70), payload)
    left.close()
    right.close()


def test_addresses() -> None:
    assert parse_tcp_address("tcp://10.0.0.7:40123") == ("10.0.0.7", 40123)
    assert parse_tcp_address("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_tcp_address("ipc:///x")


def test_staging_keeps_the_newest_copy_of_each_block_and_gives_them_back_by_index() -> None:
    store = StagingStore(BLOCK, "float32", lease_s=30)
    store.put(_header("m", 1, 0, 2, 40), _blocks(1, 2))  # block 1 partial
    store.put(_header("m", 2, 1, 2, 90), _blocks(5, 6))  # block 1 re-sent full, block 2 partial
    assert store.staged_tokens("m") == 90 and store.bytes_held == 3 * BLOCK
    staged = store.take("m")
    assert staged is not None and staged.num_tokens == 90
    assert _staged(staged, 0, 3) == _blocks(1, 5, 6)
    assert _staged(staged, 1, 2) == _blocks(5)
    with pytest.raises(KeyError, match=r"\[3\]"):
        staged.parts(2, 4)
    assert store.take("m") is None and store.bytes_held == 0 and store.staged_tokens("m") == 0


def test_staging_refuses_foreign_layouts_and_short_payloads() -> None:
    store = StagingStore(BLOCK, "float32")
    with pytest.raises(ValueError, match="layout mismatch"):
        store.put(_header("m", 1, 0, 1, 1, dtype="bfloat16"), _blocks(1))
    with pytest.raises(ValueError, match="layout mismatch"):
        store.put(_header("m", 1, 0, 1, 1, bytes_per_block=32, payload_bytes=32), b"x" * 32)
    with pytest.raises(ValueError, match="payload has"):
        store.put(_header("m", 1, 0, 2, 1), _blocks(1))
    with pytest.raises(ValueError, match="schema 9"):
        store.put(_header("m", 1, 0, 1, 1, schema_version=9), _blocks(1))
    assert len(store) == 0


def test_leases_expire_untouched_migrations_only() -> None:
    store = StagingStore(BLOCK, "float32", lease_s=10)
    store.put(_header("old", 1, 0, 1, 5), _blocks(1), now=100.0)
    store.put(_header("new", 1, 0, 1, 5), _blocks(1), now=100.0)
    store.put(_header("new", 2, 0, 1, 9), _blocks(2), now=105.0)  # renewed by its next stage
    assert store.expire(now=109.0) == []
    assert store.expire(now=110.0) == ["old"]
    assert store.staged_tokens("new") == 9
    assert store.drop("new") and not store.drop("new")
    assert store.expire(now=1e9) == []


def test_staging_reports_what_it_holds_on_every_change() -> None:
    """Every put, and every take, drop or expiry that removed something, publishes a STAGING_HELD
    event with what the store holds after it (what the engine's llumlet exports on its /metrics)."""
    events: list[MigrationEvent] = []
    store = StagingStore(BLOCK, "float32", lease_s=10, publish=events.append)

    def held() -> tuple[int, int, int]:
        last = events[-1]
        assert last.kind == MIGRATION_EVENT_KIND_STAGING_HELD and last.migration_id == ""
        return last.migrations, last.blocks, last.bytes

    store.put(_header("a", 1, 0, 2, 40), _blocks(1, 2), now=100.0)
    assert held() == (1, 2, 2 * BLOCK)
    store.put(_header("a", 2, 1, 2, 90), _blocks(5, 6), now=101.0)  # block 1 re-sent: 3 blocks, not 4
    store.put(_header("b", 1, 0, 1, 5), _blocks(1), now=101.0)
    store.put(_header("c", 1, 0, 1, 5), _blocks(1), now=108.0)
    assert held() == (3, 5, 5 * BLOCK) and store.held().bytes == store.bytes_held == 5 * BLOCK
    assert store.take("a") is not None  # loaded
    assert held() == (2, 2, 2 * BLOCK)
    assert store.drop("b")  # DropStaging
    assert held() == (1, 1, BLOCK)
    count = len(events)
    assert not store.drop("b") and store.take("b") is None and store.expire(now=109.0) == []
    assert len(events) == count  # nothing changed, nothing reported
    assert store.expire(now=118.0) == ["c"]  # lease ran out
    assert held() == (0, 0, 0)
    store.report()  # the engine's periodic report
    assert len(events) == count + 2 and held() == (0, 0, 0)


@pytest.fixture
def receiver():
    staging = StagingStore(BLOCK, "float32", lease_s=30)
    seen: list[tuple[str, int]] = []
    receiver = TcpKVReceiver("127.0.0.1", 0, staging=staging, kv_secret=SECRET,
                             on_stage=lambda header: seen.append((header.migration_id, header.stage)))
    receiver.start()
    receiver.seen = seen
    yield receiver
    receiver.close()


def test_stages_over_tcp_land_in_staging_on_one_connection(receiver) -> None:
    sender = TcpKVSender(receiver.address, timeout_s=5)
    try:
        for migration in ("a", "b"):
            assert sender.send(_header(migration, 1, 0, 2, 40), memoryview(_blocks(1, 2))).ok
            assert sender.send(_header(migration, 2, 1, 1, 64), _blocks(7)).ok
        first_connection = sender._sock
        assert first_connection is not None
    finally:
        sender.close()
    assert receiver.seen == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    staged = receiver.staging.take("b")
    assert staged.num_tokens == 64 and _staged(staged, 0, 2) == _blocks(1, 7)


def _closed(sock: socket.socket) -> bool:
    """The receiver closed the connection (a reset: it closed with our payload unread)."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("key", [b"", b"x" * 32, migration_key(SECRET, "another-migration")],
                         ids=["missing", "wrong", "another migration's"])
def test_a_frame_without_its_migrations_key_is_refused_and_nothing_is_staged(receiver, key: bytes) -> None:
    # A raw client on the KV port: a well-formed frame, but no negotiated migration behind it.
    with socket.create_connection(parse_tcp_address(receiver.address), timeout=5) as raw:
        write_frame(raw, _header("m", 1, 0, 2, 40, kv_key=key), _blocks(1, 2))
        ack = read_ack(raw)
        assert not ack.ok and "not a negotiated migration" in ack.error
        assert _closed(raw)  # before the payload was read: the connection ends
    assert len(receiver.staging) == 0 and receiver.staging.bytes_held == 0 and receiver.seen == []
    sender = TcpKVSender(receiver.address, timeout_s=5)
    try:
        with pytest.raises(KVTransportError, match="not a negotiated migration"):
            sender.send(_header("m", 1, 0, 1, 3, kv_key=key), _blocks(1))
    finally:
        sender.close()
    assert len(receiver.staging) == 0


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_bytes_that_are_no_frame_close_the_connection(receiver) -> None:
    with socket.create_connection(parse_tcp_address(receiver.address), timeout=5) as raw:
        raw.sendall(b"\x00\x00\x00\x05hello" + b"GET / HTTP/1.1\r\n\r\n")
        assert _closed(raw)
    assert len(receiver.staging) == 0 and receiver.seen == []


def test_a_pair_channel_without_the_key_is_refused_before_joining() -> None:
    staging = StagingStore(BLOCK, "float32")
    receiver = make_receiver(host="127.0.0.1", staging=staging, kv_secret=SECRET, timeout_s=5)
    receiver.start()
    try:
        hello = KVStageHeader(schema_version=KV_FRAME_SCHEMA_VERSION, migration_id="m",
                              channel=KVChannel(backend="gloo", channel_id="c", store_address="127.0.0.1:1"))
        with socket.create_connection(parse_tcp_address(receiver.address), timeout=5) as raw:
            raw.sendall(encode_message(hello))
            ack = read_ack(raw)
            assert not ack.ok and "not a negotiated migration" in ack.error
            assert _closed(raw)
    finally:
        receiver.close()
    assert len(staging) == 0


def test_a_layout_mismatch_is_refused_and_the_sender_recovers(receiver) -> None:
    sender = TcpKVSender(receiver.address, timeout_s=5)
    try:
        # A payload far larger than the socket buffers: the refusal still arrives as such.
        big = 4096
        with pytest.raises(KVTransportError, match="layout mismatch"):
            sender.send(_header("m", 1, 0, big, 1, dtype="float16"), bytes(big * BLOCK))
        connection = sender._sock
        assert receiver.staging.staged_tokens("m") == 0
        assert sender.send(_header("m", 1, 0, 1, 3), _blocks(1)).ok
        assert sender._sock is connection  # the refusal kept the connection
    finally:
        sender.close()
    assert receiver.staging.staged_tokens("m") == 3


def test_sender_reconnects_after_the_receiver_restarts() -> None:
    staging = StagingStore(BLOCK, "float32")
    first = TcpKVReceiver("127.0.0.1", 0, staging=staging, kv_secret=SECRET)
    first.start()
    host, port = parse_tcp_address(first.address)
    sender = TcpKVSender(first.address, timeout_s=5)
    try:
        assert sender.send(_header("m", 1, 0, 1, 1), _blocks(1)).ok
        first.close()

        def listening_again() -> TcpKVReceiver | None:
            try:
                return TcpKVReceiver(host, port, staging=staging, kv_secret=SECRET)
            except OSError:  # the closed listener's port is not free yet
                return None

        second = wait_until_sync(listening_again, f"port {port} free to listen on again", timeout_s=10)
        second.start()
        try:
            assert sender.send(_header("m", 2, 0, 1, 2), _blocks(2)).ok
        finally:
            second.close()
    finally:
        sender.close()
    assert staging.staged_tokens("m") == 2


def test_a_dead_destination_fails_within_the_timeout() -> None:
    # Refused connection: nothing listens on the port any more.
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(KVTransportError, match="cannot connect"):
        TcpKVSender(f"tcp://127.0.0.1:{port}", timeout_s=2).send(_header("m", 1, 0, 1, 1), _blocks(1))
    # A peer that accepts but never answers: the send times out instead of hanging.
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    sender = TcpKVSender(f"tcp://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(KVTransportError, match="timed out"):
        sender.send(_header("m", 1, 0, 1, 1), _blocks(1))
    assert time.monotonic() - started < 3
    sender.close()
    silent.close()
    for conn in accepted:
        conn.close()


def test_factories_choose_the_transport() -> None:
    staging = StagingStore(BLOCK, "float32")
    receiver = make_receiver(host="127.0.0.1", staging=staging, kv_secret=SECRET)
    assert isinstance(receiver, KVStageReceiver)
    receiver.close()
    assert isinstance(make_sender("", "tcp://127.0.0.1:1"), TcpKVSender)
    gloo = KVChannel(backend="gloo", channel_id="c", store_address="127.0.0.1:1")
    assert isinstance(make_sender("gloo", "tcp://127.0.0.1:1", channel=gloo), PairKVSender)
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        make_sender("rdma", "x")
    with pytest.raises(ValueError, match="a gloo sender needs the gloo channel the destination opened"):
        make_sender("gloo", "tcp://127.0.0.1:1")


def test_an_engine_offers_tcp_gloo_and_nccl_on_cuda_only() -> None:
    assert available_channels("cpu") == ["tcp", "gloo"]
    assert available_channels(torch.device("cpu")) == ["tcp", "gloo"]
    assert available_channels(torch.device("cuda", 0)) == ["tcp", "gloo", "nccl"]


@pytest.fixture
def rendezvous():
    opened = ChannelRendezvous("127.0.0.1", lease_s=60, timeout_s=5)
    yield opened
    opened.close()


@pytest.fixture
def pair_receiver():
    staging = StagingStore(BLOCK, "float32")
    receiver = make_receiver(host="127.0.0.1", staging=staging, kv_secret=SECRET, timeout_s=5)
    receiver.start()
    yield receiver
    receiver.close()


def _tensor(*fills: int) -> torch.Tensor:
    return torch.tensor(list(_blocks(*fills)), dtype=torch.uint8)


def test_gloo_stages_go_over_the_pair_the_destination_opened(rendezvous, pair_receiver) -> None:
    channel = rendezvous.open(OpenChannel(backend="gloo", migration_id="g"))
    assert channel.backend == "gloo" and channel.channel_id.startswith("g-")
    assert channel.store_address.startswith("127.0.0.1:")
    sender = make_sender("gloo", pair_receiver.address, timeout_s=5, channel=channel)
    try:
        assert sender.send(_header("g", 1, 0, 2, 40), _tensor(3, 4)).ok
        assert sender.send(_header("g", 2, 1, 2, 80), _tensor(5, 6)).ok  # re-sent tail block 1
        # A refused header sends nothing over the pair, which stays in step for the next stage.
        with pytest.raises(KVTransportError, match="layout mismatch"):
            sender.send(_header("g", 3, 0, 1, 1, dtype="float16"), _tensor(0))
        assert sender.send(_header("g", 4, 3, 0, 80), _tensor()).ok  # an empty stage
        staged = pair_receiver.staging.take("g")
        assert staged.num_tokens == 80
        assert _staged(staged, 0, 3) == _blocks(3, 5, 6)
    finally:
        sender.close()


def test_every_migration_gets_a_channel_of_its_own(rendezvous, pair_receiver) -> None:
    first = rendezvous.open(OpenChannel(backend="gloo", migration_id="a"))
    second = rendezvous.open(OpenChannel(backend="gloo", migration_id="b"))
    assert first.channel_id != second.channel_id and first.store_address != second.store_address
    senders = [make_sender("gloo", pair_receiver.address, timeout_s=5, channel=c) for c in (first, second)]
    try:
        for index, sender in enumerate(senders):
            assert sender.send(_header(f"m{index}", 1, 0, 1, 10), _tensor(index + 1)).ok
        assert _staged(pair_receiver.staging.take("m1"), 0, 1) == _blocks(2)
    finally:
        for sender in senders:
            sender.close()


def test_a_closed_pair_is_not_rejoined(rendezvous, pair_receiver) -> None:
    channel = rendezvous.open(OpenChannel(backend="gloo", migration_id="g"))
    sender = make_sender("gloo", pair_receiver.address, timeout_s=5, channel=channel)
    assert sender.send(_header("g", 1, 0, 1, 10), _tensor(1)).ok
    sender.close()
    with pytest.raises(KVTransportError, match="is closed"):
        sender.send(_header("g", 2, 0, 1, 10), _tensor(1))


def test_a_receiver_that_takes_tcp_only_refuses_a_pair_channel(rendezvous) -> None:
    staging = StagingStore(BLOCK, "float32")
    receiver = TcpKVReceiver("127.0.0.1", staging=staging, kv_secret=SECRET)
    receiver.start()
    channel = rendezvous.open(OpenChannel(backend="gloo", migration_id="g"))
    sender = make_sender("gloo", receiver.address, timeout_s=5, channel=channel)
    try:
        with pytest.raises(KVTransportError, match="takes KV over tcp only, not gloo"):
            sender.send(_header("g", 1, 0, 1, 10), _tensor(1))
    finally:
        sender.close()
        receiver.close()


def test_a_pair_whose_peer_never_joins_fails_within_the_timeout(pair_receiver) -> None:
    # A store that nobody serves: joining times out instead of hanging the sender thread.
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    channel = KVChannel(backend="gloo", channel_id="x", store_address=f"127.0.0.1:{port}")
    sender = make_sender("gloo", pair_receiver.address, timeout_s=1, channel=channel)
    started = time.monotonic()
    with pytest.raises(KVTransportError, match=r"gloo channel to .* failed"):
        sender.send(_header("x", 1, 0, 1, 10), _tensor(1))
    assert time.monotonic() - started < 30
    sender.close()


def test_nccl_refuses_clearly_without_cuda(rendezvous, pair_receiver) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the refusal path does not apply")
    with pytest.raises(KVTransportError, match="needs a CUDA GPU"):
        rendezvous.open(OpenChannel(backend="nccl", migration_id="n"))
    channel = KVChannel(backend="nccl", channel_id="n", nccl_unique_id=bytes(128))
    with pytest.raises(KVTransportError, match="needs a CUDA GPU"):
        make_sender("nccl", pair_receiver.address, channel=channel)


def test_nccl_stages_land_in_device_staging(rendezvous) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL refuses two ranks of one communicator on one GPU)")
    staging = StagingStore(BLOCK, "float32")
    receiver = make_receiver(host="127.0.0.1", staging=staging, kv_secret=SECRET,
                             device=torch.device("cuda", 1))
    receiver.start()
    channel = rendezvous.open(OpenChannel(backend="nccl", migration_id="g"))
    assert len(channel.nccl_unique_id) == 128
    sender = make_sender("nccl", receiver.address, channel=channel)
    try:
        for stage, fill in ((1, 3), (2, 9)):
            payload = torch.full((2 * BLOCK,), fill, dtype=torch.uint8, device="cuda:0")
            assert sender.send(_header("g", stage, stage - 1, 2, 40 * stage), payload).ok
        with pytest.raises(KVTransportError, match="layout mismatch"):
            sender.send(_header("g", 3, 0, 1, 1, dtype="float16"), torch.zeros(BLOCK, dtype=torch.uint8,
                                                                           device="cuda:0"))
        staged = staging.take("g")
        assert all(part.device.index == 1 for part in staged.parts(0, 3)) and staged.num_tokens == 80
        assert _staged(staged, 0, 3) == _blocks(3, 9, 9)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_a_cuda_engine_stages_host_payloads_in_page_locked_memory(rendezvous, backend) -> None:
    """tcp and gloo stages of an engine whose cache is on CUDA land in pinned host memory (its load at
    admission copies at the bus's speed); a CPU engine's stay in ordinary memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    staging = StagingStore(BLOCK, "float32")
    receiver = make_receiver(host="127.0.0.1", staging=staging, kv_secret=SECRET, device=torch.device("cuda"))
    receiver.start()
    channel = rendezvous.open(OpenChannel(backend="gloo", migration_id="p")) if backend == "gloo" else None
    sender = make_sender(backend, receiver.address, timeout_s=5, channel=channel)
    try:
        payload = _tensor(7, 8) if backend == "gloo" else memoryview(bytearray(_blocks(7, 8)))
        assert sender.send(_header("p", 1, 0, 2, 40), payload).ok
        staged = staging.take("p")
        assert all(isinstance(part, torch.Tensor) and part.is_pinned() for part in staged.parts(0, 2))
        assert _staged(staged, 0, 2) == _blocks(7, 8)
    finally:
        sender.close()
        receiver.close()
