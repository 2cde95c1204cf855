"""Optional API keys: from a file (one key per line, `#` comments; a mounted Secret) and/or an
environment variable (comma-separated). Compared in constant time."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

API_KEYS_ENV = "LLUMNIX_API_KEYS"


def load_api_keys(path: Path | None = None, env_var: str = API_KEYS_ENV) -> tuple[bytes, ...]:
    keys: list[str] = []
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        keys += [line.split("#", 1)[0].strip() for line in text.splitlines()]
    keys += [k.strip() for k in os.environ.get(env_var, "").split(",")]
    return tuple(dict.fromkeys(k.encode() for k in keys if k))


class ApiKeyChecker:
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, authorization: str | None) -> bool:
        """`Authorization: Bearer <key>`; every key is compared (no early exit on a match)."""
        if not self.keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(presented, key)
        return matched
