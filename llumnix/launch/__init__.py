"""Starting and supervising engine and llumlet processes: command building (also for the operator's
pods), one child-process manager, and the engine + llumlet pair that local mode, the benchmarks and the
tests start (docs/architecture.md)."""
