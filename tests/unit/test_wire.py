"""proto <-> Python conversions of the llumlet API (llumnix/wire.py)."""

from __future__ import annotations

import math

import pytest

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.wire import (
    LoadReport,
    LoadSource,
    chunk_from_proto,
    chunk_to_proto,
    endpoint_from_proto,
    endpoint_to_proto,
    load_from_proto,
    report_from_proto,
    report_to_proto,
)


def _report(**overrides: object) -> LoadReport:
    load = InstanceLoad(
        instance_id="i-0",
        total_blocks=1000,
        free_blocks=640,
        block_size=32,
        running=(RequestLoad("a", 100, 7, 4, True, 12.5), RequestLoad("b", 33, 0, 2)),
        waiting=(RequestLoad("c", 400, arrival_time=13.0, migrating=True),),
        draining=False,
        preemptions=3,
        migrating_out=1,
        migrating_in=2,
        reserved_blocks=5,
        timestamp=1700000000.25,
    )
    fields = {"load": load, "freeness": 123.5, "virtual_usage": 377.0, "snapshot_age_s": 0.012,
              "source": LoadSource.CONNECTOR, "sequence": 42}
    fields.update(overrides)
    return LoadReport(**fields)  # type: ignore[arg-type]


def test_load_report_round_trips_through_the_wire_format() -> None:
    report = _report()
    wire = pb.InstanceLoad.FromString(report_to_proto(report).SerializeToString())
    assert report_from_proto(wire) == report
    assert load_from_proto(wire) == report.load


def test_draining_instance_keeps_infinite_usage_and_fallback_source() -> None:
    report = _report(freeness=-math.inf, virtual_usage=math.inf, source=LoadSource.METRICS_FALLBACK)
    back = report_from_proto(pb.InstanceLoad.FromString(report_to_proto(report).SerializeToString()))
    assert back.freeness == -math.inf
    assert back.virtual_usage == math.inf
    assert back.source is LoadSource.METRICS_FALLBACK


def test_unknown_enum_values_are_refused() -> None:
    with pytest.raises(ValueError, match="load source"):
        report_from_proto(pb.InstanceLoad(source=pb.LOAD_SOURCE_UNSPECIFIED))
    with pytest.raises(ValueError, match="endpoint"):
        endpoint_from_proto(pb.ENDPOINT_UNSPECIFIED)


@pytest.mark.parametrize("endpoint", list(EndpointKind))
def test_endpoint_round_trip(endpoint: EndpointKind) -> None:
    assert endpoint_from_proto(endpoint_to_proto(endpoint)) is endpoint


@pytest.mark.parametrize(
    "chunk",
    [
        GenerationChunk(index=1, token_ids=(5, 6), text="ab", prompt_token_ids=(1, 2, 3), model="tiny",
                        role="assistant", logprobs={"content": [{"token": "a", "logprob": -0.5}]},
                        extra_delta={"reasoning_content": "hm"}),
        GenerationChunk(token_ids=(9,), text="z", finish_reason="stop", stop_reason="\n",
                        usage=Usage(3, 4)),
        GenerationChunk(finish_reason="stop", stop_reason=2),
        GenerationChunk(usage=Usage(10, 0)),
    ],
)
def test_generation_chunk_round_trip(chunk: GenerationChunk) -> None:
    wire = pb.GenerateChunk.FromString(chunk_to_proto(chunk).SerializeToString())
    assert chunk_from_proto(wire) == chunk


def test_usage_is_absent_until_the_last_chunk() -> None:
    assert not chunk_to_proto(GenerationChunk(token_ids=(1,))).HasField("usage")
    assert chunk_to_proto(GenerationChunk(usage=Usage(2, 3))).usage.total_tokens == 5
