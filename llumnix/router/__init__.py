"""The router: an OpenAI-compatible gateway that dispatches requests over llumlets by their live load
(see docs/router.md)."""
