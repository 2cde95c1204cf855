"""Several router processes behind one port (`llumnix router --workers N`), for hosts where one
Python process is the limit.

Each worker is a whole router: it subscribes to every llumlet's load stream and dispatches from those
loads plus its own in-flight requests, exactly as separate router replicas do (router state is
rebuilt from the load streams only, so workers share nothing). The kernel spreads connections over
the workers (SO_REUSEPORT). Their Prometheus metrics are summed across workers (prometheus_client's
multiprocess mode), so a scrape that lands on any worker sees the whole router.

The supervisor reserves the port (bound, not listening), starts the workers, restarts one that dies,
and on SIGTERM/SIGINT passes the signal on and waits for each worker's graceful shutdown.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from prometheus_client import multiprocess

logger = logging.getLogger("llumnix.router.workers")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
RESTART_BACKOFF_S = 1.0


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and not listening: the port is taken for the
    workers (0 picks a free one) and no connection is ever queued on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def supervise(workers: int, port: int, start_worker: Callable[[int], None]) -> int:
    """Runs `start_worker(port)` in `workers` processes until a signal; returns the exit status."""
    context = multiprocessing.get_context("spawn")  # no fork: gRPC and event loops do not survive it
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for process in running:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def spawn() -> BaseProcess:
        process = context.Process(target=start_worker, args=(port,), name="llumnix-router-worker")
        process.start()
        return process

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    running = [spawn() for _ in range(workers)]
    logger.info("router workers started", extra={"workers": workers, "port": port,
                                                 "pids": [p.pid for p in running]})
    status = 0
    while running:
        for process in list(running):
            process.join(timeout=0.2)
            if process.exitcode is None:
                continue
            running.remove(process)
            if process.pid is not None:
                multiprocess.mark_process_dead(process.pid)
            if not stopping:
                logger.warning("router worker died; starting another",
                               extra={"pid": process.pid, "exit_code": process.exitcode})
                time.sleep(RESTART_BACKOFF_S)
                running.append(spawn())
            elif process.exitcode != 0:
                status = 1
    logger.info("router workers stopped")
    return status


def metrics_dir() -> str:
    """A fresh directory for the workers' shared metric files (set in the environment the workers
    inherit, before any metric exists)."""
    path = tempfile.mkdtemp(prefix="llumnix-router-metrics-")
    os.environ[METRICS_DIR_ENV] = path
    return path
