"""Live migration between llumlets: the source's state machine, the destination's reservations and
the `LlumletMigration` gRPC service (proto/llumnix/v1/migration.proto)."""
