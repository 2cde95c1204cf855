"""One client request's output, served by one or more instances and spliced into one stream.

- Before the first token: an instance that is unavailable (refusal, connection error) is skipped
  for a while and the request is sent again through dispatch.
- After the first token: if the instance fails, the request resumes on another instance by token
  replay (`replay.py`).
- On `Moved` (the request migrated live) the router attaches to the destination's stream
  (`GenerateRequest(attach=true)` on its `Serve` stream), which continues from the first token
  produced there; only if attaching fails (not found, destination gone) does it fall back to token
  replay.
- Splicing: replayed chunks lose what the client already has (prompt token ids, the chat role), and
  usage is recomputed at the end, so the client sees one response and each token once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from llumnix.load import RequestLoad
from llumnix.openai_replay import NotReplayable, remaining_max_tokens, replay_body
from llumnix.openai_request import PromptSizer
from llumnix.openai_stream import EndpointKind, GenerationChunk, Usage
from llumnix.router.dispatcher import DispatchQueue
from llumnix.router.errors import RouterError
from llumnix.router.instances import Instance, InstanceSet
from llumnix.router.metrics import RouterMetrics
from llumnix.router.serve_session import InstanceStreamDown
from llumnix.v1 import llumlet_pb2 as pb
from llumnix.wire import chunk_from_proto, endpoint_to_proto

logger = logging.getLogger("llumnix.router.generation")

INSTANCE_FAILURE_STATUSES = frozenset({502, 503, 504})
"""Failures of the instance (refused while draining or with its engine down) rather than of the
request: try elsewhere. A broken stream (llumlet gone, connection lost) is one too; so is a failed
attach (404: the migrated request is not there), which continues by replay."""


@dataclass(frozen=True, slots=True)
class ClientRequest:
    request_id: str
    endpoint: EndpointKind
    body: dict[str, Any]
    """What is forwarded: the client's body minus the router's own fields."""
    high_priority: bool
    prompt_tokens_estimate: int


@dataclass(slots=True)
class _Output:
    """What the client has been sent so far."""

    prompt_token_ids: tuple[int, ...] = ()
    generated: dict[int, list[int]] = field(default_factory=dict)
    role_sent: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    chunks_sent: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.generated.values())


@dataclass(frozen=True, slots=True)
class GenerationLimits:
    max_attempts: int = 4
    """Instances one request may be sent to: the first, then one per retry or replay after a failure.
    Following a live migration is not an attempt: the request runs on at the destination, however
    often the control loop moves it, and giving up there would lose it."""
    max_model_len: int | None = None


class Generation:
    def __init__(self, request: ClientRequest, queue: DispatchQueue, instances: InstanceSet,
                 metrics: RouterMetrics, limits: GenerationLimits, prompt_sizer: PromptSizer) -> None:
        self.request = request
        self.prompt_sizer = prompt_sizer
        self.queue = queue
        self.instances = instances
        self.metrics = metrics
        self.limits = limits
        self.out = _Output()
        self.usage: Usage | None = None
        self.instance_id = "none"
        """The instance that served the last part of the request."""
        self.model = ""
        self.first_token_at: float | None = None
        self._replayed = False

    def final_usage(self) -> Usage:
        if self.usage is not None and not self._replayed:
            return self.usage
        return Usage(len(self.out.prompt_token_ids), self.out.tokens)

    async def batches(self) -> AsyncIterator[list[GenerationChunk]]:
        """The spliced output, in the batches it arrived in (never empty); raises RouterError when the
        request cannot be completed."""
        endpoint, body = self.request.endpoint, self.request.body
        prompt_tokens = self.queue.dispatcher.prompt_ids
        prompt_ids = prompt_tokens(endpoint, body)  # looked up in the prefix caches
        prefix_root = prompt_tokens.root(body)
        target: Instance | None = None
        attach_id: str | None = None  # after a move: the next call attaches at the destination
        failures = 0
        while True:
            sub_id = attach_id or (self.request.request_id if failures == 0
                                   else f"{self.request.request_id}.{failures}")
            load = RequestLoad(sub_id, self.request.prompt_tokens_estimate + self.out.tokens,
                               high_priority=self.request.high_priority, arrival_time=time.time(),
                               prompt_token_ids=prompt_ids, prefix_root=prefix_root)
            if target is None:
                instance = await self.queue.acquire(load, self.request.high_priority)
            else:
                instance, target = target, None
                instance.reserve(load)
            self.instance_id = instance.instance_id
            if attach_id is not None:
                stream = instance.serve.start(pb.GenerateRequest(request_id=attach_id, attach=True))
            else:
                stream = instance.serve.start(pb.GenerateRequest(
                    request_id=sub_id, endpoint=endpoint_to_proto(endpoint),
                    body_json=orjson.dumps(body).decode(),
                    priority=pb.PRIORITY_HIGH if self.request.high_priority else pb.PRIORITY_NORMAL))
            attaching, attach_id = attach_id is not None, None
            ending: pb.ServeEvent | None = None
            failure: str | None = None
            try:
                while ending is None:
                    batch = []
                    for event in await stream.next_events():
                        if not event.HasField("chunk"):
                            ending = event
                            break
                        chunk = self._splice(chunk_from_proto(event.chunk))
                        if chunk is not None:
                            batch.append(chunk)
                    if batch:
                        yield batch
            except InstanceStreamDown as exc:
                instance.mark_unavailable()
                failure = str(exc)
            finally:
                stream.close()
                instance.release(sub_id)
            if ending is not None and ending.HasField("failure"):
                error = RouterError.from_failure(ending.failure.status, ending.failure.body_json)
                instance_failed = error.status in INSTANCE_FAILURE_STATUSES
                if not instance_failed and not (attaching and error.status == 404):
                    raise error
                if instance_failed:
                    instance.mark_unavailable()
                failure = f"{error.status}: {error}"
            moved = ending.moved if ending is not None and ending.HasField("moved") else None
            if moved is not None:
                self.metrics.moves.inc()
                logger.info("following a migrated request", extra={
                    "request_id": self.request.request_id, "instance_id": instance.instance_id,
                    "destination": moved.address, "tokens_sent": self.out.tokens})
                target = self.instances.connection(moved.address)
                if moved.request_id:
                    attach_id = moved.request_id
                    continue
                failure = "moved without a request id to attach to"  # continue there by replay
            elif failure is None:
                if self._complete():
                    instance.mark_available()
                    return
                failure = "the stream ended before the request finished"
            resume = self._resume(failure, instance, counted=moved is not None)
            if resume is None:
                return
            failures += 1
            if failures >= self.limits.max_attempts:
                raise RouterError(503, f"the request failed on {self.limits.max_attempts} instances; retry "
                                  "later", "ServiceUnavailableError", retry_after_s=1.0)
            endpoint, body = resume

    def _complete(self) -> bool:
        return bool(self.out.finished) and self.out.finished.issuperset(self.out.generated)

    def _resume(self, failure: str, instance: Instance, counted: bool = False
                ) -> tuple[EndpointKind, dict[str, Any]] | None:
        """The endpoint and body to continue with; None when nothing is left to generate. `counted`:
        a move already counted (not a retry or replay)."""
        log = {"request_id": self.request.request_id, "instance_id": instance.instance_id,
               "tokens_sent": self.out.tokens}
        if self.out.tokens == 0:
            if not counted:
                self.metrics.retries.inc()
                logger.info("retrying on another instance", extra={**log, "reason": failure})
            return self.request.endpoint, self.request.body
        generated = self.out.generated.get(0, [])
        try:
            if remaining_max_tokens(self.request.endpoint, self.request.body, len(self.out.prompt_token_ids),
                                    len(generated), self.limits.max_model_len) <= 0:
                self.out.finished.add(0)
                return None
            body = replay_body(self.request.endpoint, self.request.body, self.out.prompt_token_ids,
                               generated, self.limits.max_model_len)
        except NotReplayable as exc:
            raise RouterError(503, f"the instance serving the request failed and it cannot be resumed: "
                              f"{exc}", "ServiceUnavailableError") from None
        self._replayed = True
        if not counted:
            self.metrics.replays.inc()
            logger.warning("resuming by token replay", extra={**log, "reason": failure})
        return EndpointKind.COMPLETION, body

    def _splice(self, chunk: GenerationChunk) -> GenerationChunk | None:
        out = self.out
        self.model = self.model or chunk.model
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.prompt_token_ids and not out.prompt_token_ids:
            out.prompt_token_ids = chunk.prompt_token_ids
            prompt_ids = chunk.prompt_token_ids
            # The first prompt ids are always the client's own prompt's (a replay comes after them).
            self.prompt_sizer.learn(self.request.endpoint, self.request.body, len(prompt_ids))
        else:
            prompt_ids = ()
        role = chunk.role if chunk.role and chunk.index not in out.role_sent else ""
        if role:
            out.role_sent.add(chunk.index)
        if chunk.token_ids:
            out.generated.setdefault(chunk.index, []).extend(chunk.token_ids)
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
        if chunk.finish_reason is not None:
            out.finished.add(chunk.index)
            out.generated.setdefault(chunk.index, [])
        # The chunk was decoded for this request alone: adjust it in place.
        chunk.prompt_token_ids = prompt_ids
        chunk.role = role
        chunk.usage = None
        chunk.model = self.model or chunk.model
        if not (chunk.token_ids or chunk.text or chunk.finish_reason or chunk.role
                or chunk.extra_delta or chunk.prompt_token_ids or chunk.logprobs is not None):
            return None
        out.chunks_sent += 1
        return chunk
