"""The router's view of a prompt's token ids: exact for token-id prompts; with the model's tokenizer
also text completions (special tokens added) and string-only chats (chat template, then no special
tokens), as vLLM tokenizes them; nothing for what it cannot reproduce (multimodal inputs and prompt
embeddings included); the root of their hashes from the cache salt and the LoRA adapter."""

from __future__ import annotations

from pathlib import Path

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
