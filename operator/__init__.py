"""The Kubernetes operator (import name `llumnix_operator`)."""
