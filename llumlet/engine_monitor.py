"""Background watchers of the engine: its snapshot channel, its /health and its /metrics."""

from __future__ import annotations

import asyncio
import logging
import time

from llumlet.admission import Admission
from llumlet.engine_client import EngineHealth, EngineUnavailableError
from llumlet.engine_metrics import MetricsFormatError, parse_engine_metrics
from llumlet.load_tracker import LoadTracker
from llumnix.engine.snapshots import SnapshotSubscriber

logger = logging.getLogger("llumlet.engine")


async def read_snapshots(subscriber: SnapshotSubscriber, tracker: LoadTracker) -> None:
    """Feeds every snapshot the connector publishes to the load tracker, until cancelled."""
    while True:
        try:
            snapshot = await subscriber.receive(timeout_s=1.0)
        except ValueError as exc:
            logger.error("dropping engine snapshot", extra={"reason": str(exc)})
            continue
        if snapshot is not None:
            tracker.on_snapshot(snapshot, time.time())


async def watch_engine(admission: Admission, tracker: LoadTracker, interval_s: float = 0.5,
                       failures_to_unhealthy: int = 2, slow_grace_s: float = 15.0) -> None:
    """Polls the engine's /health (and /metrics while snapshots lag). After `failures_to_unhealthy`
    failed health checks in a row (connection refused, error status) the engine is marked down: new
    requests are refused and in-flight ones fail, so a dead engine shows within about
    interval_s * failures_to_unhealthy. Checks that merely time out count only once they have lasted
    `slow_grace_s`: a CPU engine busy with a long prefill answers late, and failing its in-flight
    requests then would turn load into errors."""
    failures = 0
    slow_since: float | None = None
    while True:
        started = time.monotonic()
        health = await admission.engine.health(timeout_s=max(1.0, interval_s))
        healthy = health is EngineHealth.HEALTHY
        if health is EngineHealth.SLOW:
            slow_since = started if slow_since is None else slow_since
            failures = failures + 1 if started - slow_since >= slow_grace_s else failures
        else:
            slow_since = None
            failures = 0 if healthy else failures + 1
        if healthy and not admission.engine_healthy:
            logger.info("engine is healthy")
            admission.engine_healthy = True
        elif failures == failures_to_unhealthy and admission.engine_healthy:
            admission.engine_healthy = False
            failed = admission.fail_all(503, "the engine serving this request stopped responding",
                                        "EngineUnavailable")
            logger.error("engine is not healthy", extra={"failed_requests": failed, "check": health.value})
        # /metrics is the fallback source: read it only once snapshots lag (rendering it costs the
        # engine's API server a few milliseconds each time).
        if healthy and tracker.snapshot_health().age_s > tracker.snapshot_timeout_s / 2:
            await _poll_metrics(admission, tracker)
        tracker.notify()
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def _poll_metrics(admission: Admission, tracker: LoadTracker) -> None:
    try:
        status, body, _ = await admission.engine.get("/metrics", timeout_s=2.0)
        if status == 200:
            tracker.on_metrics(parse_engine_metrics(body.decode()), time.time())
    except (EngineUnavailableError, MetricsFormatError, ValueError) as exc:
        logger.debug("engine metrics unavailable", extra={"reason": str(exc)})
