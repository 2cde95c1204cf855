"""Conversions between the llumlet gRPC messages (proto/llumnix/v1/llumlet.proto) and the Python
types the llumlet, the router and the operator compute with. Nothing else builds these messages
field by field."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from llumnix.load import InstanceLoad, RequestLoad
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage
from llumnix.v1 import llumlet_pb2 as pb


class LoadSource(str, enum.Enum):
    CONNECTOR = "connector"
    METRICS_FALLBACK = "metrics-fallback"


_SOURCE_TO_PB = {LoadSource.CONNECTOR: pb.LOAD_SOURCE_CONNECTOR,
                 LoadSource.METRICS_FALLBACK: pb.LOAD_SOURCE_METRICS_FALLBACK}
_SOURCE_FROM_PB = {v: k for k, v in _SOURCE_TO_PB.items()}
_ENDPOINT_TO_PB = {EndpointKind.COMPLETION: pb.ENDPOINT_COMPLETION, EndpointKind.CHAT: pb.ENDPOINT_CHAT}
_ENDPOINT_FROM_PB = {v: k for k, v in _ENDPOINT_TO_PB.items()}


@dataclass(frozen=True, slots=True)
class PrefixChanges:
    """What changed in an instance's prefix cache since the previous load of a stream (canonical
    block hashes, `llumnix.prefix_cache`); `full`: `stored` is the whole cache."""

    full: bool
    stored: tuple[int, ...]
    removed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An instance's load as a llumlet reports it: the snapshot plus what it computed from it."""

    load: InstanceLoad
    freeness: float
    virtual_usage: float
    snapshot_age_s: float
    source: LoadSource
    sequence: int = 0
    prefix_changes: PrefixChanges | None = None
    """Only on a load stream (`WatchLoad`): its prefix-cache changes since its previous load."""


def source_to_proto(source: LoadSource) -> int:
    return _SOURCE_TO_PB[source]


def source_from_proto(value: int) -> LoadSource:
    try:
        return _SOURCE_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown load source {value}") from None


def endpoint_to_proto(endpoint: EndpointKind) -> int:
    return _ENDPOINT_TO_PB[endpoint]


def endpoint_from_proto(value: int) -> EndpointKind:
    try:
        return _ENDPOINT_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown endpoint {value}; expected completion or chat") from None


def request_load_to_proto(request: RequestLoad) -> pb.RequestLoad:
    return pb.RequestLoad(
        request_id=request.request_id,
        prompt_tokens=request.prompt_tokens,
        output_tokens=request.output_tokens,
        blocks=request.blocks,
        high_priority=request.high_priority,
        arrival_time=request.arrival_time,
        migrating=request.migrating,
    )


def request_load_from_proto(msg: pb.RequestLoad) -> RequestLoad:
    return RequestLoad(
        request_id=msg.request_id,
        prompt_tokens=msg.prompt_tokens,
        output_tokens=msg.output_tokens,
        blocks=msg.blocks,
        high_priority=msg.high_priority,
        arrival_time=msg.arrival_time,
        migrating=msg.migrating,
    )


def report_to_proto(report: LoadReport) -> pb.InstanceLoad:
    load = report.load
    return pb.InstanceLoad(
        instance_id=load.instance_id,
        total_blocks=load.total_blocks,
        free_blocks=load.free_blocks,
        block_size=load.block_size,
        running=[request_load_to_proto(r) for r in load.running],
        waiting=[request_load_to_proto(r) for r in load.waiting],
        draining=load.draining,
        preemptions=load.preemptions,
        migrating_out=load.migrating_out,
        migrating_in=load.migrating_in,
        reserved_blocks=load.reserved_blocks,
        timestamp=load.timestamp,
        freeness=report.freeness,
        virtual_usage=report.virtual_usage,
        snapshot_age_s=report.snapshot_age_s,
        source=source_to_proto(report.source),
        sequence=report.sequence,
    )


def report_from_proto(msg: pb.InstanceLoad) -> LoadReport:
    load = InstanceLoad(
        instance_id=msg.instance_id,
        total_blocks=msg.total_blocks,
        free_blocks=msg.free_blocks,
        block_size=msg.block_size,
        running=tuple(request_load_from_proto(r) for r in msg.running),
        waiting=tuple(request_load_from_proto(r) for r in msg.waiting),
        draining=msg.draining,
        preemptions=msg.preemptions,
        migrating_out=msg.migrating_out,
        migrating_in=msg.migrating_in,
        reserved_blocks=msg.reserved_blocks,
        timestamp=msg.timestamp,
    )
    changes = None
    if msg.HasField("prefix_cache"):
        cache = msg.prefix_cache
        changes = PrefixChanges(cache.full, tuple(cache.stored), tuple(cache.removed))
    return LoadReport(
        load=load,
        freeness=msg.freeness,
        virtual_usage=msg.virtual_usage,
        snapshot_age_s=msg.snapshot_age_s,
        source=source_from_proto(msg.source),
        sequence=msg.sequence,
        prefix_changes=changes,
    )


def load_from_proto(msg: pb.InstanceLoad) -> InstanceLoad:
    """The policies' input (dispatch, migration, autoscaling) from a streamed load."""
    return report_from_proto(msg).load


def chunk_to_proto(chunk: GenerationChunk, msg: pb.GenerateChunk | None = None) -> pb.GenerateChunk:
    """The chunk as a message, written into `msg` when given (a field of an enclosing message)."""
    # Only the fields that are set: a message is built for every token, and most fields are empty.
    if msg is None:
        msg = pb.GenerateChunk()
    msg.index = chunk.index
    msg.token_ids.extend(chunk.token_ids)
    msg.text = chunk.text
    if chunk.finish_reason:
        msg.finish_reason = chunk.finish_reason
    if chunk.stop_reason is not None:
        msg.stop_reason_json = json.dumps(chunk.stop_reason)
    if chunk.prompt_token_ids:
        msg.prompt_token_ids.extend(chunk.prompt_token_ids)
    if chunk.model:
        msg.model = chunk.model
    if chunk.role:
        msg.role = chunk.role
    if chunk.logprobs is not None:
        msg.logprobs_json = json.dumps(chunk.logprobs)
    if chunk.extra_delta:
        msg.extra_delta_json = json.dumps(chunk.extra_delta)
    if chunk.usage is not None:
        msg.usage.prompt_tokens = chunk.usage.prompt_tokens
        msg.usage.completion_tokens = chunk.usage.completion_tokens
        msg.usage.total_tokens = chunk.usage.total_tokens
    return msg


def chunk_from_proto(msg: pb.GenerateChunk) -> GenerationChunk:
    stop_reason = json.loads(msg.stop_reason_json) if msg.stop_reason_json else None
    return GenerationChunk(
        index=msg.index,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=msg.finish_reason or None,
        stop_reason=stop_reason if isinstance(stop_reason, (int, str)) else None,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        model=msg.model,
        usage=(Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if msg.HasField("usage")
               else None),
        role=msg.role,
        logprobs=json.loads(msg.logprobs_json) if msg.logprobs_json else None,
        extra_delta=json.loads(msg.extra_delta_json) if msg.extra_delta_json else {},
    )
