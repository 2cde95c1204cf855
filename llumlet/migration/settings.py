"""A llumlet's migration settings (LlumletConfig.migration; `llumnix llumlet --migration-*` flags)."""

from __future__ import annotations

from dataclasses import dataclass

from llumnix.policies.migration import DEFAULT_MIGRATION, SELECT_POLICIES, MigrationConfig

TRANSPORTS = ("auto", "tcp", "gloo", "nccl")

@dataclass(frozen=True, slots=True)
class MigrationSettings:
    max_concurrent: int = DEFAULT_MIGRATION.max_concurrent_per_instance
    """Migrations this instance takes part in at once (in and out together)."""
    select: str = DEFAULT_MIGRATION.select
    """Which request MigrateOut moves when it is not named (MIGRATION_SELECT_UNSPECIFIED)."""
    freeness_threshold: float = DEFAULT_MIGRATION.freeness_threshold
    """A destination takes a request only if its freeness stays at or above this afterwards."""
    max_stages: int = 8
    """Stages before the final one at most (0: one blocking copy)."""
    final_delta_blocks: int = 2
    """The final stage starts once at most this many blocks are left to send."""
    lease_s: float = 10.0
    """A destination's reservation, staging and unattached output live this long unless renewed."""
    stage_timeout_s: float = 30.0
    """How long the source waits for one stage to be sent."""
    peer_timeout_s: float = 10.0
    """Propose, Renew and Abort calls to the destination."""
    commit_timeout_s: float = 60.0
    """Commit answers after the destination's first token (a prefill of the unstaged tokens)."""
    transport: str = "auto"
    """The KV channel migrations use (negotiated in Propose, llumlet/migration/rules.py choose_channel):
    "tcp", "gloo" or "nccl" takes only that one; "auto" takes nccl when both engines are on CUDA and
    TCP otherwise."""

    def __post_init__(self) -> None:
        if self.select not in SELECT_POLICIES:
            raise ValueError(f"unknown request selection {self.select!r}; choose one of {SELECT_POLICIES}")
        if self.max_concurrent < 1:
            raise ValueError("the maximum of concurrent migrations must be at least 1")
        if self.max_stages < 0 or self.final_delta_blocks < 0 or self.lease_s <= 0:
            raise ValueError("migration stages, final delta and lease must not be negative")
        if self.commit_timeout_s <= 0:
            raise ValueError("the migration commit timeout must be positive")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown migration transport {self.transport!r}; choose one of {TRANSPORTS}")

    @property
    def policy(self) -> MigrationConfig:
        return MigrationConfig.with_threshold(self.freeness_threshold, self.select, self.max_concurrent)
