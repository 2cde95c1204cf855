"""Discrete-event simulator of a cluster of vLLM instances (`llumnix simulate`).

- `request`, `instance`: a vLLM (v0) engine with paged KV blocks, continuous batching, preemption.
- `migration`: multi-stage live migration of one request between two instances.
- `cluster`: the event loop; dispatch, migration pairing and autoscaling come from `llumnix.policies`.
- `systems`: the compared systems and the one default configuration; `metrics`: what a run reports.
- `runner`, `experiments`, `report`, `cli`: runs, the paper's experiments as presets, the command.
"""
