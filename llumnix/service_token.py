"""The service credential: one random token per LLMService that every caller of a llumlet presents —
the router, the control loop, migration peers, the drain hook. The operator keeps it in a Secret
(`<service>-llumlet-token`) and injects it as an environment variable; local mode generates one per run
and hands it to its children the same way, so it never shows on a command line.

On the wire it is `authorization: Bearer <token>`: gRPC call metadata, or the HTTP header."""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

SERVICE_TOKEN_ENV = "LLUMNIX_SERVICE_TOKEN"
AUTHORIZATION_METADATA = "authorization"
"""gRPC metadata keys are lower case; HTTP's `Authorization` header is the same name."""
SECRET_KEY = "token"
"""The key of the token in the operator's Secret."""

CallMetadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class ServiceToken:
    value: str

    def __post_init__(self) -> None:
        if not self.value or self.value != self.value.strip():
            raise ValueError("a service token is a non-empty string without surrounding whitespace")

    def __repr__(self) -> str:  # never in a log line or a traceback
        return "ServiceToken(<redacted>)"

    @classmethod
    def generate(cls) -> ServiceToken:
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ServiceToken | None:
        """The token in `$LLUMNIX_SERVICE_TOKEN`; None when it is unset or empty."""
        value = environ.get(SERVICE_TOKEN_ENV, "").strip()
        return cls(value) if value else None

    @property
    def authorization(self) -> str:
        return f"Bearer {self.value}"

    def environment(self) -> dict[str, str]:
        """What a child process needs in its environment to hold this token."""
        return {SERVICE_TOKEN_ENV: self.value}

    def accepts(self, authorization: str | None) -> bool:
        """`Bearer <token>`, compared in constant time."""
        scheme, _, presented = (authorization or "").partition(" ")
        candidate = presented.strip() if scheme.lower() == "bearer" else ""
        return hmac.compare_digest(candidate.encode(), self.value.encode())


def call_metadata(token: ServiceToken | None) -> CallMetadata:
    """The gRPC metadata a call to a llumlet carries (none without a token)."""
    return ((AUTHORIZATION_METADATA, token.authorization),) if token is not None else ()
