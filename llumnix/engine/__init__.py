"""The engine side: what runs inside an engine process (vLLM with the llumnix KV connector, or the sim
engine). The connector and its KV blocks, migration plan and worker, the KV transports, the engine
channel's server, the load snapshots and the handshake record. It imports only the core and
`llumnix.v1`; the sidecar (`llumlet/`) talks to it through the protocol modules (`snapshots`,
`engine_channel`, `handshake`), never the other way round (docs/architecture.md)."""
