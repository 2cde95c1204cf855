"""The sim engine's model: a byte-level tokenizer, a chat template and a deterministic "sampler".

- A token is one UTF-8 byte (ids 0..255); id 256 is the end-of-sequence token. The vocabulary is
  LLaMA's size, so prompts given as token ids may use ids up to 31999 (they have no text).
- A generated token is a printable ASCII character (ids 32..126) chosen by hashing the engine seed
  and the last `CONTEXT_TOKENS` token ids of the whole sequence (prompt + generated so far). So the
  output depends only on the sequence, never on batching, timing or the instance: a request
  resubmitted with prompt = its prompt + the tokens generated so far continues with exactly the
  tokens it would have produced (what migration and token replay rely on).
- With `eos_probability` > 0 the same hash ends the sequence with that probability per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EOS_TOKEN_ID = 256
VOCAB_SIZE = 32000
CONTEXT_TOKENS = 4
"""How many trailing token ids decide the next one."""
_FIRST_PRINTABLE = 32
_PRINTABLE = 95
_MASK64 = (1 << 64) - 1


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def token_text(token_id: int) -> str:
    """Text of one generated token (always a whole character)."""
    return "" if token_id == EOS_TOKEN_ID else chr(token_id)


def message_text(content: Any) -> str:
    """A chat message's content: a string, a list of parts (text parts are kept) or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(part.get("text") or "")
        for part in content
        if isinstance(part, dict) and part.get("type", "text") == "text"
    )


def apply_chat_template(messages: Sequence[dict[str, Any]]) -> str:
    """`<|role|>` headers around each message, then the assistant's header (add_generation_prompt)."""
    parts = [f"<|{m['role']}|>\n{message_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _mix(h: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash step with plain integer arithmetic."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    return h ^ (h >> 31)


class TokenGenerator:
    """Picks each sequence's next token as a pure function of (seed, its last few token ids)."""

    def __init__(self, seed: int = 0, eos_probability: float = 0.0) -> None:
        if not 0.0 <= eos_probability < 1.0:
            raise ValueError(f"eos probability must be in [0, 1), got {eos_probability}")
        self._seed_hash = _mix(seed & _MASK64)
        self._eos_threshold = int(eos_probability * (1 << 32))

    def next_token(self, sequence: Sequence[int], eos_allowed: bool) -> int:
        h = self._seed_hash
        for token_id in sequence[-CONTEXT_TOKENS:]:
            h = _mix(h ^ token_id)
        if eos_allowed and (h >> 32) < self._eos_threshold:
            return EOS_TOKEN_ID
        return _FIRST_PRINTABLE + h % _PRINTABLE
