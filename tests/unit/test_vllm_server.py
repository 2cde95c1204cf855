"""The engine wrapper's detokenizer priming: a prompt that ends inside a multi-byte character (a request
resumed after a migration or by token replay) streams only the new text, as a stream that saw the
whole prompt token by token does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")

from llumnix.engine.vllm_server import PrimedDecodeStream  # noqa: E402


def test_a_prompt_ending_mid_character_streams_only_the_new_text(tiny_model_dir: Path) -> None:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prefix = tokenizer.encode("The quick brown fox jumps over the lazy dog and then").ids
    rng = random.Random(0)
    cut_prompts = 0
    for _ in range(50):
        prompt = prefix + [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        following = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(8)]
        cut_prompts += tokenizer.decode(prompt).endswith("\ufffd")
        stepped = tokenizers.decoders.DecodeStream(skip_special_tokens=False)
        for token in prompt:
            stepped.step(tokenizer, token)
        primed = PrimedDecodeStream(ids=prompt, skip_special_tokens=False)
        expected = "".join(stepped.step(tokenizer, t) or "" for t in following)
        assert "".join(primed.step(tokenizer, t) or "" for t in following) == expected
        assert "The quick brown fox" not in expected
    assert cut_prompts > 0  # the case that matters was exercised
