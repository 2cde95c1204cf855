"""The llumlet: the sidecar next to each engine (admission, HTTP and gRPC fronts, load tracking,
migration coordination). The code that runs inside the engine is `llumnix.engine`."""
