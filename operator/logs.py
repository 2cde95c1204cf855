"""The operator's logs: one JSON object per line (`llumnix.jsonlog`, as every other component), each
line about an LLMService carrying `llmservice` and `namespace`.

kopf's per-object loggers name the object in their `k8s_ref` extra; the control loop that a daemon
runs logs through plain loggers, so the daemon sets `current_service` and every task it starts
inherits it (context variables follow asyncio tasks)."""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from llumnix.jsonlog import JsonFormatter, configure_json_logging

current_service: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "llumnix_operator_service", default=None
)
"""(namespace, name) of the LLMService whose daemon runs the current task."""

_KOPF_EXTRAS = ("k8s_ref", "k8s_skip", "settings")
"""What kopf's object loggers attach: the reference is turned into our two fields, the rest dropped."""


@contextmanager
def service_context(namespace: str, name: str) -> Iterator[None]:
    token = current_service.set((namespace, name))
    try:
        yield
    finally:
        current_service.reset(token)


class OperatorJsonFormatter(JsonFormatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _KOPF_EXTRAS}
        ref = getattr(record, "k8s_ref", None)
        service = (ref.get("namespace"), ref.get("name")) if isinstance(ref, dict) else current_service.get()
        if service is not None and "llmservice" not in fields:
            fields["namespace"], fields["llmservice"] = service
        return super().format(logging.makeLogRecord(fields))


def configure_operator_logging(level: str) -> None:
    """JSON lines on stderr; `instance` is the operator's pod name (its host name in a pod)."""
    instance_id = os.environ.get("HOSTNAME") or "llumnix-operator"
    configure_json_logging(instance_id, level)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OperatorJsonFormatter(instance_id))
