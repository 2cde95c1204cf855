"""The llumlet's book of the requests it admitted: what each asked for and what it has produced so
far (prompt token ids, sampling parameters, generated token ids per choice). Enough to resume a
request elsewhere (migration, replay) and to mark high-priority requests in the load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llumnix.openai_request import BYTES_PER_TOKEN_ESTIMATE, estimate_prompt_tokens
from llumnix.openai_stream import EndpointKind, GenerationChunk

# Request fields that are not sampling parameters (kept out of `RequestRecord.sampling_params`).
_NON_SAMPLING_FIELDS = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "kv_transfer_params", "user",
    "return_token_ids", "request_id",
})


class DuplicateRequestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """How a request continues after its engine stream stopped part-way (migrated in, or resumed on the
    source by recompute): a completion whose prompt is the original prompt plus the tokens generated so
    far (`body`, the llumlet adds its own fields), counted on top of `generated_before`."""

    body: dict[str, Any]
    generated_before: int


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    endpoint: EndpointKind
    body: dict[str, Any]
    """The request as the client sent it."""
    high_priority: bool = False
    admitted_at: float = field(default_factory=time.time)
    prompt_token_ids: tuple[int, ...] = ()
    generated_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Choice index -> tokens generated so far."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    migratable: bool = False
    """Its stream can end with a move (gRPC callers follow `Moved`; the HTTP front cannot)."""
    resume: ResumePoint | None = None
    """Set once the request continues from a resume point rather than from `body`."""
    bytes_per_token: float = field(default=BYTES_PER_TOKEN_ESTIMATE, repr=False)
    """The engine's text size of a token as known at admission (`PromptSizer`)."""
    prompt_estimate: int = field(init=False, repr=False)
    """The client's prompt length as estimated at admission (every load report reads it until the
    engine reports the exact length)."""

    def __post_init__(self) -> None:
        self.prompt_estimate = estimate_prompt_tokens(self.endpoint, self.body, self.bytes_per_token)

    @property
    def sampling_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.body.items() if k not in _NON_SAMPLING_FIELDS}

    @property
    def started(self) -> bool:
        """The engine has answered with the first chunk (the prompt has been prefilled)."""
        return bool(self.prompt_token_ids) or bool(self.generated_token_ids)

    @property
    def output_tokens(self) -> int:
        return max((len(t) for t in self.generated_token_ids.values()), default=0)

    @property
    def prompt_tokens(self) -> int:
        """Exact once the engine reported the prompt, an estimate before."""
        if self.prompt_token_ids:
            return len(self.prompt_token_ids)
        return self.prompt_estimate

    @property
    def engine_endpoint(self) -> EndpointKind:
        """A resumed request is a completion over token ids whatever the client called."""
        return EndpointKind.COMPLETION if self.resume is not None else self.endpoint

    def observe(self, chunk: GenerationChunk) -> None:
        if chunk.prompt_token_ids and not self.prompt_token_ids:
            self.prompt_token_ids = chunk.prompt_token_ids
        if chunk.token_ids:
            self.generated_token_ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finish_reasons[chunk.index] = chunk.finish_reason


class RequestTable:
    """Requests admitted and not yet finished, in admission order."""

    def __init__(self) -> None:
        self._records: dict[str, RequestRecord] = {}
        self.admitted_total = 0
        self.finished_total = 0

    def add(self, record: RequestRecord) -> None:
        if record.request_id in self._records:
            raise DuplicateRequestError(f"request id {record.request_id!r} is already running here")
        self._records[record.request_id] = record
        self.admitted_total += 1

    def remove(self, request_id: str) -> RequestRecord | None:
        record = self._records.pop(request_id, None)
        if record is not None:
            self.finished_total += 1
        return record

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def high_priority_ids(self) -> frozenset[str]:
        return frozenset(r.request_id for r in self._records.values() if r.high_priority)
