"""The llumlet: the sidecar next to each engine, and the engine-side pieces it talks to."""
