"""The token ids of a request's prompt as the engine will see them, for looking its prefix up in the
instances' prefix caches.

Without a tokenizer the router knows them only for a completion whose prompt is one list of token
ids. With the model's tokenizer (`llumnix router --tokenizer PATH`) it also tokenizes a text
completion (special tokens added, as vLLM's completions do) and a chat whose messages are strings
(the tokenizer's chat template with the generation prompt, then tokenized without special tokens, as
vLLM's chat does). Anything else (batches, content parts, tools, a template that fails) gets no ids:
it is dispatched by load alone. So do multimodal requests (images and the like come only as chat
content parts) and prompt embeddings: vLLM hashes their blocks with the inputs' own hashes, which the
router cannot compute, and a lookup by token ids alone could find blocks the engine would not reuse.

The ids chain from the request's root (`PromptTokens.root`): its `cache_salt` and LoRA adapter, the
rest of what vLLM puts into its block hashes.
"""

from __future__ import annotations

from typing import Any

from llumnix.openai_stream import EndpointKind
from llumnix.prefix_cache import root_hash


def token_id_prompt(endpoint: EndpointKind, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt's token ids; empty when the prompt is text, a batch or a chat."""
    if endpoint is not EndpointKind.COMPLETION:
        return ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return ()


class PromptTokens:
    """`prompt_tokens(endpoint, body)`: the prompt's token ids, or () where they are not known;
    `prompt_tokens.root(body)`: the root their block hashes chain from."""

    def __init__(self, tokenizer: Any | None = None, served_model: str | None = None) -> None:
        self.tokenizer = tokenizer
        """A Hugging Face tokenizer (duck-typed: `encode`, `apply_chat_template`), or None."""
        self.served_model = served_model
        """The engines' base model name; a request's `model` naming anything else names a LoRA
        adapter of theirs. None: every request is taken to target the base model."""

    @classmethod
    def load(cls, path: str | None, served_model: str | None = None) -> PromptTokens:
        """The model's tokenizer from a local folder (None: token-id prompts only)."""
        if path is None:
            return cls(served_model=served_model)
        from transformers import AutoTokenizer  # only a router given a tokenizer needs transformers

        return cls(AutoTokenizer.from_pretrained(path), served_model)

    def root(self, body: dict[str, Any]) -> int:
        """The root of the request's block hashes: its `cache_salt` (vLLM salts its first block
        with it) and the LoRA adapter its `model` names (vLLM keys every block with it: the
        engines serve an adapter under its `--lora-modules` name). A `model` the engines do not
        serve is answered 404 by them; an alias of the base model hashes as an adapter, which can
        only miss blocks, never find one the engine would not reuse."""
        salt, model = body.get("cache_salt"), body.get("model")
        adapter = (model if isinstance(model, str) and model and self.served_model is not None
                   and model != self.served_model else None)
        return root_hash(salt if isinstance(salt, str) else None, adapter)

    def __call__(self, endpoint: EndpointKind, body: dict[str, Any]) -> tuple[int, ...]:
        if body.get("prompt_embeds") is not None:
            return ()
        ids = token_id_prompt(endpoint, body)
        tokenizer = self.tokenizer
        if ids or tokenizer is None:
            return ids
        try:
            if endpoint is EndpointKind.COMPLETION:
                prompt = body.get("prompt")
                return tuple(tokenizer.encode(prompt)) if isinstance(prompt, str) and prompt else ()
            messages = body.get("messages")
            if not isinstance(messages, list) or body.get("tools") or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
            ):
                return ()
            text = tokenizer.apply_chat_template(
                [{"role": m.get("role"), "content": m["content"]} for m in messages],
                add_generation_prompt=True, tokenize=False,
            )
            return tuple(tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # a template that cannot render this conversation: dispatch by load
            return ()
