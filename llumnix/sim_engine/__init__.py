"""`llumnix sim-engine`: a real-time simulated engine that speaks vLLM's OpenAI HTTP API and publishes
the KV connector's load snapshots, so that llumlets, routers and the operator can run tens of
instances on one machine (docs/sim-engine.md).

- `tokens`: byte-level tokenizer, chat template and the deterministic next-token function.
- `requests`, `responses`: OpenAI request validation and response shapes, as vLLM 0.32 has them.
- `engine`: the simulator's `SimInstance` stepped in real time; `snapshot`: its `EngineSnapshot`.
- `metrics`: vLLM's Prometheus series; `server`: the aiohttp app; `cli`: the command.
"""
