"""The token ids of a request's prompt as the engine will see them, for looking its prefix up in the
instances' prefix caches.

Without a tokenizer the router knows them only for a completion whose prompt is one list of token
ids. With the model's tokenizer (`llumnix router --tokenizer PATH`) it also tokenizes a text
completion (special tokens added unless `add_special_tokens` is false, as vLLM's completions do) and
a chat whose messages are strings (the tokenizer's chat template with the generation prompt, or
continuing the final message, and the request's `chat_template_kwargs`; then tokenized without
special tokens unless `add_special_tokens` is true, as vLLM's chat does). `truncate_prompt_tokens`
cuts the ids as vLLM's generate runner does (its last N, or its first N with `truncation_side:
"right"`). Anything else (batches, content parts, tools, the request's own `chat_template`,
truncation to the unknown model length (-1), a template that fails) gets no ids: it is dispatched by
load alone. So do multimodal requests (images and the like come only as chat
content parts) and prompt embeddings: vLLM hashes their blocks with the inputs' own hashes, which the
router cannot compute, and a lookup by token ids alone could find blocks the engine would not reuse.

The ids chain from the request's root (`PromptTokens.root`): its `cache_salt` and LoRA adapter, the
rest of what vLLM puts into its block hashes.
"""

from __future__ import annotations

from typing import Any

from llumnix.openai_stream import EndpointKind
from llumnix.prefix_cache import root_hash

_TEMPLATE_CALL_ARGUMENTS = frozenset({"conversation", "tools", "chat_template", "tokenize", "return_dict",
                                      "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "return_assistant_tokens_mask"})
"""Parameters of the tokenizer's `apply_chat_template` itself: a request's chat_template_kwargs
naming one is not rendered here (vLLM's template resolution treats it otherwise)."""


def token_id_prompt(endpoint: EndpointKind, body: dict[str, Any]) -> tuple[int, ...]:
    """The prompt's token ids; empty when the prompt is text, a batch or a chat."""
    if endpoint is not EndpointKind.COMPLETION:
        return ()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return ()


def truncated(body: dict[str, Any], ids: tuple[int, ...]) -> tuple[int, ...]:
    """`ids` as the engine keeps them under the request's `truncate_prompt_tokens`: vLLM's generate
    runner keeps the last N (its tokenizers truncate from the left) unless `truncation_side` is
    "right". -1 (the model's length, unknown here) or a malformed value: no ids."""
    limit = body.get("truncate_prompt_tokens")
    if limit is None:
        return ids
    if type(limit) is not int or limit < 0:
        return ()
    if limit >= len(ids):
        return ids
    return ids[:limit] if body.get("truncation_side") == "right" else ids[len(ids) - limit:]


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
        if not ids and self.tokenizer is not None:
            try:
                ids = self._tokenized(endpoint, body)
            except Exception:  # a template that cannot render this conversation: dispatch by load
                return ()
        return truncated(body, ids)

    def _tokenized(self, endpoint: EndpointKind, body: dict[str, Any]) -> tuple[int, ...]:
        """A text completion's or a string-only chat's ids, with vLLM's defaults for the fields that
        change them."""
        tokenizer = self.tokenizer
        special = body.get("add_special_tokens", endpoint is EndpointKind.COMPLETION)
        if not isinstance(special, bool):
            return ()
        if endpoint is EndpointKind.COMPLETION:
            prompt = body.get("prompt")
            return tuple(tokenizer.encode(prompt, add_special_tokens=special)) \
                if isinstance(prompt, str) and prompt else ()
        messages, options = body.get("messages"), body.get("chat_template_kwargs") or {}
        if not isinstance(messages, list) or body.get("tools") or body.get("chat_template") \
                or not isinstance(options, dict) or _TEMPLATE_CALL_ARGUMENTS & options.keys() or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return ()
        # As vLLM's chat renders: the request's own fields over its chat_template_kwargs (unset ones
        # left out), and a reasoning effort switching thinking on or off unless the kwargs say.
        fields = {"add_generation_prompt": body.get("add_generation_prompt", True),
                  "continue_final_message": body.get("continue_final_message", False),
                  "documents": body.get("documents"), "reasoning_effort": body.get("reasoning_effort")}
        options = {**options, **{k: v for k, v in fields.items() if v not in (None, "auto")}}
        if body.get("reasoning_effort") is not None and "enable_thinking" not in options:
            options["enable_thinking"] = body["reasoning_effort"] != "none"
        text = tokenizer.apply_chat_template(
            [{"role": m.get("role"), "content": m["content"]} for m in messages], tokenize=False,
            **options)
        return tuple(tokenizer.encode(text, add_special_tokens=special))
