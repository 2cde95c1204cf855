from llumnix.engine.engine_snapshot import EngineState, RequestRow, build_snapshot, waiting_order
from llumnix.engine.snapshots import SNAPSHOT_SCHEMA_VERSION


def row(rid: str, *, queued: bool = False, preempted: bool = False, arrival: float = 0.0, blocks: int = 0,
        prompt: int = 10, output: int = 0, computed: int = 0, high: bool = False) -> RequestRow:
    return RequestRow(rid, f"eng-{rid}", prompt, output, computed, blocks, high, arrival, queued, preempted)


def test_running_and_waiting_split_with_all_fields():
    state = EngineState(
        timestamp=123.5, total_blocks=100, free_blocks=60, preemptions_total=3,
        requests=[row("a", blocks=3, prompt=70, output=5, computed=75, high=True, arrival=1.0),
                  row("b", queued=True, arrival=2.0)],
    )
    snap = build_snapshot("engine-0", 7, 32, state)
    assert snap.schema_version == SNAPSHOT_SCHEMA_VERSION
    assert (snap.engine_id, snap.step, snap.timestamp) == ("engine-0", 7, 123.5)
    assert (snap.total_blocks, snap.free_blocks, snap.block_size, snap.preemptions_total) == (100, 60, 32, 3)
    assert [r.request_id for r in snap.running] == ["a"]
    a = snap.running[0]
    assert (a.engine_request_id, a.prompt_tokens, a.output_tokens, a.computed_tokens, a.blocks) == (
        "eng-a", 70, 5, 75, 3)
    assert a.high_priority and a.arrival_time == 1.0
    assert [r.request_id for r in snap.waiting] == ["b"]
    assert snap.waiting[0].blocks == 0


def test_waiting_order_puts_preempted_first_then_arrival():
    rows = [row("late", queued=True, arrival=5.0), row("early", queued=True, arrival=1.0),
            row("preempted", queued=True, preempted=True, arrival=9.0), row("running", arrival=0.0)]
    assert [r.request_id for r in waiting_order(rows)] == ["preempted", "early", "late"]


def test_rows_built_without_the_namedtuple_constructor_work():
    fast = tuple.__new__(RequestRow, ("x", "e", 1, 2, 3, 4, False, 0.5, False, False))
    snap = build_snapshot("e", 1, 32, EngineState(0.0, 10, 10, 0, [fast]))
    assert snap.running[0].computed_tokens == 3 and snap.running[0].blocks == 4


def test_serialised_snapshot_round_trips():
    from llumnix.v1.engine_pb2 import EngineSnapshot

    snap = build_snapshot("e", 2, 16, EngineState(1.0, 8, 4, 1, [row("a", blocks=4)]))
    assert EngineSnapshot.FromString(snap.SerializeToString()) == snap


def test_capture_rows_reads_vllm_request_fields():
    from types import SimpleNamespace

    from llumnix.engine.engine_snapshot import capture_rows

    running = SimpleNamespace(num_prompt_tokens=70, num_output_tokens=5, num_computed_tokens=74,
                              kv_transfer_params={"llumlet_id": "a", "high_priority": True},
                              arrival_time=1.0, status="RUNNING")
    preempted = SimpleNamespace(num_prompt_tokens=9, num_output_tokens=2, num_computed_tokens=0,
                                kv_transfer_params=None, arrival_time=2.0, status="PREEMPTED")
    rows = capture_rows([("eng-a", ("a", running)), ("eng-b", ("eng-b", preempted))],
                        scheduled={"eng-a": 1}, blocks_of={"eng-a": 3, "eng-b": 0}.__getitem__,
                        running_status="RUNNING", preempted_status="PREEMPTED")
    assert rows[0] == RequestRow("a", "eng-a", 70, 5, 75, 3, True, 1.0, False, False)
    assert rows[1] == RequestRow("eng-b", "eng-b", 9, 2, 0, 0, False, 2.0, True, True)
