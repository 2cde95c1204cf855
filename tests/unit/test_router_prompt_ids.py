"""The router's view of a prompt's token ids: exact for token-id prompts; with the model's tokenizer
also text completions (special tokens added) and string-only chats (chat template, then no special
tokens), as vLLM tokenizes them; nothing for what it cannot reproduce (multimodal inputs and prompt
embeddings included); the root of their hashes from the cache salt and the LoRA adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from llumnix.openai_stream import EndpointKind
from llumnix.prefix_cache import ROOT_HASH, root_hash
from llumnix.router.prompt_ids import PromptTokens

COMPLETION, CHAT = EndpointKind.COMPLETION, EndpointKind.CHAT
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def test_without_a_tokenizer_only_token_ids_are_known() -> None:
    ids = PromptTokens()
    assert ids(COMPLETION, {"prompt": [5, 6, 7]}) == (5, 6, 7)
    assert ids(COMPLETION, {"prompt": "text"}) == ()
    assert ids(COMPLETION, {"prompt": [[1, 2], [3]]}) == ()
    assert ids(CHAT, {"messages": MESSAGES}) == ()


def test_with_the_models_tokenizer_text_and_chat_are_tokenized_as_vllm_does(tiny_model_dir: Path) -> None:
    ids = PromptTokens.load(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ids(COMPLETION, {"prompt": "hello world"}) == tuple(tokenizer.encode("hello world"))
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids(CHAT, {"messages": MESSAGES}) == tuple(tokenizer.encode(rendered, add_special_tokens=False))
    assert ids(COMPLETION, {"prompt": [5, 6]}) == (5, 6)
    # What the router cannot reproduce exactly is dispatched by load.
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert ids(CHAT, {"messages": parts}) == ()
    assert ids(CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}) == ()
    assert ids(COMPLETION, {"prompt": ["a", "b"]}) == ()


class _WithBos:
    """The tiny model's tokenizer adding a BOS id (999) as Llama's does: the tiny one adds none."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [999] * add_special_tokens + self.tokenizer.encode(text, add_special_tokens=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def test_the_fields_vllm_tokenizes_by_are_honoured(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = PromptTokens(_WithBos(tokenizer))
    text = "hello world, and then some more words"
    plain = tuple(tokenizer.encode(text, add_special_tokens=False))
    assert ids(COMPLETION, {"prompt": text}) == (999, *plain)
    assert ids(COMPLETION, {"prompt": text, "add_special_tokens": False}) == plain
    # vLLM's generate runner keeps the last N ids, or the first N with truncation_side "right".
    full = ids(COMPLETION, {"prompt": text})
    assert ids(COMPLETION, {"prompt": text, "truncate_prompt_tokens": 4}) == full[-4:]
    right = {"prompt": text, "truncate_prompt_tokens": 4, "truncation_side": "right"}
    assert ids(COMPLETION, right) == full[:4]
    assert ids(COMPLETION, {"prompt": [1, 2, 3], "truncate_prompt_tokens": 2}) == (2, 3)
    assert ids(COMPLETION, {"prompt": [1, 2, 3], "truncate_prompt_tokens": 9}) == (1, 2, 3)
    assert ids(COMPLETION, {"prompt": [1, 2, 3], "truncate_prompt_tokens": -1}) == ()  # the model's length
    assert ids(COMPLETION, {"prompt": text, "add_special_tokens": "no"}) == ()
    continued = [*MESSAGES, {"role": "assistant", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(continued, continue_final_message=True, tokenize=False)
    continuing = {"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    assert ids(CHAT, continuing) == tuple(tokenizer.encode(rendered, add_special_tokens=False))
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    templated = tuple(tokenizer.encode(rendered, add_special_tokens=False))
    assert ids(CHAT, {"messages": MESSAGES}) == templated
    assert ids(CHAT, {"messages": MESSAGES, "add_special_tokens": True}) == (999, *templated)
    # A template of the request's own, or kwargs that are the renderer's parameters: dispatch by load.
    assert ids(CHAT, {"messages": MESSAGES, "chat_template": "{{ messages }}"}) == ()
    assert ids(CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}) == ()


def test_the_root_carries_the_cache_salt_and_the_lora_adapter_the_model_names() -> None:
    ids = PromptTokens(served_model="tiny")
    assert ids.root({"model": "tiny", "prompt": [1]}) == ROOT_HASH
    assert ids.root({"prompt": [1]}) == ROOT_HASH  # no model: the served one
    assert ids.root({"model": "tiny", "cache_salt": "s"}) == root_hash("s")
    assert ids.root({"model": "adapter-1"}) == root_hash(None, "adapter-1")
    assert ids.root({"model": "adapter-1", "cache_salt": "s"}) == root_hash("s", "adapter-1")
    assert ids.root({"model": "tiny", "cache_salt": ""}) == ROOT_HASH  # vLLM refuses it anyway


def test_multimodal_and_embedding_prompts_get_no_ids(tiny_model_dir: Path) -> None:
    # vLLM keys their blocks with the inputs' own hashes: no lookup by token ids may claim them.
    ids = PromptTokens.load(str(tiny_model_dir), "tiny")
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, picture]}]
    assert ids(CHAT, {"messages": image}) == ()
    assert ids(COMPLETION, {"prompt": [5, 6], "prompt_embeds": "AAAA"}) == ()
    assert ids(COMPLETION, {"prompt": "text", "prompt_embeds": "AAAA"}) == ()
