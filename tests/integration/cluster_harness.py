"""What the cluster-in-a-test modules share: waiting for an event with a deadline that fails loudly,
a steady closed-loop load through the router, and the router's /health."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from waiting import wait_until_sync


def wait_for(fn: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """`waiting.wait_until_sync` in the argument order these modules use; returns `fn`'s first
    truthy answer."""
    return wait_until_sync(fn, what or repr(fn), timeout)


def sim_service(name: str, replicas: int) -> dict[str, Any]:
    """An LLMService of sim engine pods (1 to 3), migrating every 200 ms."""
    return {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "sim"},
            "replicas": replicas,
            "instances": {"min": 1, "max": 3},
            "engine": {"runtime": "sim", "resources": {"gpus": 0}},
            "migration": {"intervalMs": 200},
            "autoscaling": {"startupGraceSeconds": 120},
        },
    }


class Load:
    """Clients sending completions through the router, each waiting for its answer before the next."""

    def __init__(self, url: str, clients: int = 6, max_tokens: int = 128) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        body = json.dumps({"model": "sim", "prompt": "hello there", "max_tokens": self.max_tokens}).encode()
        while not self._stop.is_set():
            request = urllib.request.Request(
                f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
                assert answer["choices"][0]["text"]
                self.ok += 1
            except Exception as exc:
                self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
