"""Which running requests can move, over which KV channel (negotiated in Propose), and the request
that continues one on another engine.

A migrated request restarts on the destination as a completion whose prompt is the original prompt
plus every token generated so far (`llumnix.openai_replay.replay_body`), with the remaining
max_tokens and min_tokens and the same sampling parameters. State the engine keeps beyond the token
sequence does not survive that restart, so requests that depend on it are refused:
- n > 1 / best_of > 1: several sequences share one request;
- presence/frequency penalties: they count output tokens only, which become prompt tokens;
- seeded sampling with temperature > 0: the per-request generator restarts from its seed;
- stop strings: the engine holds back text that may begin a stop string (lost at the switch) and a
  stop string spanning the boundary would be missed;
- structured output, tools, echo, prompt logprobs, and chat requests refused by token replay.
Greedy and unseeded sampled requests move; logprobs continue for the new tokens.
"""

from __future__ import annotations

from typing import Any

from llumlet.requests import RequestRecord, ResumePoint
from llumnix.openai_replay import NotReplayable, replay_body

_STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def migration_refusal(record: RequestRecord) -> str | None:
    """Why `record` cannot migrate now (None: it can)."""
    body = record.body
    if not record.migratable:
        return "requests admitted through the llumlet's HTTP front are not migrated (its stream cannot move)"
    if not record.prompt_token_ids or not record.generated_token_ids:
        return "the request has not produced its first token yet"
    if record.finish_reasons:
        return "the request is finishing"
    try:
        resume_point(record)
    except NotReplayable as exc:
        return str(exc)
    for key in ("presence_penalty", "frequency_penalty"):
        if float(body.get(key) or 0.0) != 0.0:
            return f"{key} counts output tokens, which become prompt tokens after a migration"
    if body.get("seed") is not None and float(body.get("temperature", 1.0) or 0.0) > 0.0:
        return "seeded sampling would restart its random generator on the destination"
    if body.get("stop"):
        return "stop strings are not migrated (held-back text and a stop string across the switch)"
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        return "echo and prompt_logprobs would cover the generated tokens after a migration"
    if any(body.get(key) is not None for key in _STRUCTURED_FIELDS) or body.get("tools"):
        return "structured output and tools keep parser state that does not migrate"
    if (body.get("response_format") or {}).get("type", "text") != "text":
        return "structured output keeps parser state that does not migrate"
    return None


CPU_DEFAULT_CHANNEL = "tcp"
"""What `auto` takes when the engines cannot both use NCCL: TCP measured as fast as gloo or faster on
CPU engines (docs/migration.md, "TCP or gloo on CPU")."""


def engine_channels(handshake: dict[str, object]) -> list[str]:
    """The KV channels an engine receives and sends on (its handshake's kv_channels; tcp when absent)."""
    channels = handshake.get("kv_channels")
    return [str(c) for c in channels] if isinstance(channels, list) and channels else ["tcp"]


def choose_channel(source_transport: str, destination_transport: str, source_channels: list[str],
                   destination_channels: list[str]) -> tuple[str, str | None]:
    """The KV channel of a migration, from both llumlets' `--migration-transport` and both engines'
    channels: (channel, None), or ("", why not). A llumlet set to tcp, gloo or nccl takes only that;
    with both on `auto`, nccl when both engines are on CUDA, else `CPU_DEFAULT_CHANNEL`."""
    source_transport = source_transport or "auto"
    wanted = {t for t in (source_transport, destination_transport) if t != "auto"}
    if len(wanted) > 1:
        return "", (f"the source llumlet migrates KV over {source_transport} only, the destination over "
                    f"{destination_transport} only")
    if wanted:
        channel = wanted.pop()
    elif "nccl" in source_channels and "nccl" in destination_channels:
        channel = "nccl"
    else:
        channel = CPU_DEFAULT_CHANNEL
    for side, channels in (("source", source_channels), ("destination", destination_channels)):
        if channel not in channels:
            need = " (it needs a CUDA GPU on both engines)" if channel == "nccl" else ""
            return "", (f"the KV channel is {channel}{need}; the {side} engine has only "
                        f"{', '.join(channels)}")
    return channel, None


def answer_refusal(transport: str, source_channels: list[str], chosen: str,
                   channel_backend: str) -> str | None:
    """Why the source (set to `transport`, its engine on `source_channels`) cannot use the channel a
    destination chose in its Propose answer (None: it can); a pair channel comes with its rendezvous."""
    if transport != "auto" and chosen != transport:
        return f"this llumlet migrates KV over {transport} only; the destination chose {chosen}"
    if chosen not in source_channels:
        return f"the destination chose {chosen}; this engine has only {', '.join(source_channels)}"
    if chosen != "tcp" and channel_backend != chosen:
        return f"the destination chose {chosen} but opened no {chosen} channel"
    return None


def resume_point(record: RequestRecord, kv_params: dict[str, Any] | None = None,
                 max_model_len: int | None = None) -> ResumePoint:
    """The completion that continues `record` after the tokens it generated so far; `kv_params` are
    the connector's migration fields (staged tokens). Raises `NotReplayable` when nothing is left."""
    generated = record.generated_token_ids.get(0, [])
    body = replay_body(record.endpoint, record.body, record.prompt_token_ids, generated, max_model_len)
    body["kv_transfer_params"] = dict(kv_params or {})
    return ResumePoint(body=body, generated_before=len(generated))


def usable_staged_tokens(staged_tokens: int, record: RequestRecord) -> int:
    """Staged KV the destination may load: the engine may have computed tokens the llumlet never read
    (its stream was cut), and the newest token's KV is always recomputed with the next step."""
    return max(0, min(staged_tokens, len(record.prompt_token_ids) + record.output_tokens - 1))
