"""The operator's own HTTP endpoint beside kopf's liveness probe: `/metrics` (Prometheus) and
`/readyz` (200 once kopf has started: CRDs found, startup handlers run, watches begun; a standby
replica under peering is ready too, it takes over when the active one goes).

It runs on a thread, apart from kopf's event loop, so a scrape is answered even while the loop is
busy, and readiness says what kopf itself reports through its ready flag."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from llumnix_operator.metrics import OperatorMetrics


class OperatorEndpoint:
    def __init__(self, host: str, port: int, metrics: OperatorMetrics, ready: threading.Event) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    endpoint._answer(self, 200, endpoint.metrics.exposition(), CONTENT_TYPE_LATEST)
                elif self.path == "/readyz":
                    ok = endpoint.ready.is_set()
                    endpoint._answer(self, 200 if ok else 503, b"ready\n" if ok else b"starting\n",
                                     "text/plain")
                else:
                    endpoint._answer(self, 404, b"not found\n", "text/plain")

            def log_message(self, format: str, *args: object) -> None:
                """Scrapes and probes are not worth a log line each."""

        self.metrics = metrics
        self.ready = ready
        self.server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="operator-endpoint",
                                        daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        handler.send_response(code)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
