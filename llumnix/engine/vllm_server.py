"""`python -m llumnix.engine.vllm_server ARGS`: vLLM's OpenAI API server
(`vllm.entrypoints.openai.api_server`) with its detokenizer primed so that resumed requests do not
repeat their prompt's text.

vLLM primes each request's incremental detokenizer with `tokenizers.decoders.DecodeStream(ids=prompt)`.
When the prompt's text ends inside a multi-byte character, that stream (tokenizers 0.23) emits the
whole prompt's text with the first output token. A request resumed after a migration or by token
replay has a prompt that ends with the tokens generated so far, which often stop mid-character, so
the client would receive the prompt and its own text again. Here the stream is primed by stepping
through the prompt's last tokens, which keeps its place at the last complete character (vLLM looks
`DecodeStream` up on the module so that such a replacement is honoured).

Before anything else it refuses a vLLM outside the range the connector supports (llumnix/vllm_support.py),
so an engine built on another release fails at start-up with both versions in its error.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence

import tokenizers.decoders
from tokenizers import Tokenizer

from llumnix.vllm_support import UnsupportedVllmError, check_vllm_version

PRIME_TOKENS = 32
"""Prompt tokens stepped through: enough to reach a character boundary and the decoder's context."""


class PrimedDecodeStream:
    """A DecodeStream primed lazily (priming needs the tokenizer, which only `step` receives)."""

    native = tokenizers.decoders.DecodeStream

    def __init__(self, ids: Sequence[int] | None = None, skip_special_tokens: bool = False) -> None:
        self._stream = self.native(skip_special_tokens=skip_special_tokens)
        self._prompt_tail = list(ids or ())[-PRIME_TOKENS:]

    def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
        if self._prompt_tail:
            for prompt_token in self._prompt_tail:
                self._stream.step(tokenizer, prompt_token)
            self._prompt_tail = []
        return self._stream.step(tokenizer, token_id)


def main() -> None:
    import vllm  # the version alone; the server below imports the rest

    try:
        check_vllm_version(vllm.__version__)
    except UnsupportedVllmError as exc:
        sys.exit(f"llumnix engine: {exc}")
    tokenizers.decoders.DecodeStream = PrimedDecodeStream  # type: ignore[misc,assignment]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
