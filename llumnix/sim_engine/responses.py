"""The sim engine's OpenAI response bodies, field for field as vLLM 0.32 serialises them (streamed
chunks drop unset fields; whole responses carry every field, null when unused)."""

from __future__ import annotations

from typing import Any

from llumnix import __version__
from llumnix.openai_stream import EndpointKind
from llumnix.sim_engine.engine import TokenDelta
from llumnix.sim_engine.requests import GenerationRequest

SYSTEM_FINGERPRINT = f"llumnix-sim-engine-{__version__}"


class ResponseWriter:
    """Builds one request's stream chunks and its whole response."""

    def __init__(self, params: GenerationRequest, response_id: str, created: int, model: str) -> None:
        self.params = params
        self.chat = params.endpoint is EndpointKind.CHAT
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }
        self.response_id = response_id
        self.created = created
        self.model = model
        self._sent_prompt_ids = False

    def _prompt_ids(self) -> list[int] | None:
        return list(self.params.prompt_token_ids) if self.params.return_token_ids else None

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.params.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    # ----- streaming

    def chunks(self, delta: TokenDelta) -> list[dict[str, Any]]:
        """The chunks one step's delta becomes (a chat stream opens with the assistant's role)."""
        token_ids = list(delta.token_ids) if self.params.return_token_ids else None
        out: list[dict[str, Any]] = []
        if self.chat:
            if not self._sent_prompt_ids:
                out.append(
                    {
                        **self.head,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        "prompt_token_ids": self._prompt_ids(),
                        "prompt_text": None,
                    }
                )
                self._sent_prompt_ids = True
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": delta.text},
                "logprobs": None,
                "finish_reason": delta.finish_reason,
            }
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            choice["token_ids"] = token_ids
        else:
            choice = {
                "index": 0,
                "text": delta.text,
                "logprobs": None,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
                "prompt_token_ids": None if self._sent_prompt_ids else self._prompt_ids(),
                "token_ids": token_ids,
            }
            self._sent_prompt_ids = True
        chunk = {**self.head, "choices": [choice]}
        if delta.finish_reason is not None and not self.params.include_usage:
            chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
        out.append(chunk)
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {
            **self.head,
            "choices": [],
            "usage": self._usage(completion_tokens),
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    # ----- whole response

    def response(
        self, text: str, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
        else:
            choice["text"] = text
        choice.update(
            logprobs=None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            token_ids=token_ids if self.params.return_token_ids else None,
        )
        if not self.chat:
            choice.update(prompt_logprobs=None, prompt_token_ids=self._prompt_ids())
        choice["routed_experts"] = None
        usage = {
            **self._usage(len(token_ids)),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
        }
        if self.chat:
            body.update(prompt_logprobs=None, prompt_token_ids=self._prompt_ids(), prompt_text=None)
        # vLLM echoes what its KV connector returns when the request finishes; it returns nothing here.
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return body
