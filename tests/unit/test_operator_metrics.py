"""The operator's metrics, its /metrics + /readyz endpoint and its JSON log lines."""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llumnix.cli import build_parser
from llumnix.control.status import InstanceStatus, ServiceStatus
from llumnix_operator import cli, handlers
from llumnix_operator.http_endpoint import OperatorEndpoint
from llumnix_operator.logs import OperatorJsonFormatter, service_context
from llumnix_operator.metrics import SCALING_DIRECTION, OperatorMetrics

SERVICE = {"llmservice_namespace": "prod", "llmservice": "llama"}


def samples(metrics: OperatorMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def status(aggregate: float | None) -> ServiceStatus:
    return ServiceStatus(
        "llama",
        3,
        (
            InstanceStatus("llama-a", "ready", "a:1", 20.0, running=2),
            InstanceStatus("llama-b", "ready", "b:1", -math.inf, draining=True),
            InstanceStatus("llama-c", "starting", None, None),
        ),
        aggregate_freeness=aggregate,
        migrations={"committed": 4, "aborted": 1},
    )


def test_each_llmservice_reports_desired_ready_serving_and_its_aggregate_freeness() -> None:
    metrics = OperatorMetrics()
    metrics.publish("prod", "llama", status(12.5))
    found = samples(metrics)
    assert found["llumnix_operator_desired_instances"] == [(SERVICE, 3.0)]
    assert found["llumnix_operator_ready_instances"] == [(SERVICE, 2.0)]
    assert found["llumnix_operator_serving_instances"] == [(SERVICE, 1.0)]
    assert found["llumnix_operator_draining_instances"] == [(SERVICE, 1.0)]
    assert found["llumnix_operator_aggregate_freeness"] == [(SERVICE, 12.5)]
    assert found["llumnix_operator_spec_valid"] == [(SERVICE, 1.0)]
    migrations = {labels["outcome"]: value for labels, value in found["llumnix_operator_migrations_total"]}
    # every outcome from the start (rate() of a series born at its first event shows nothing)
    assert migrations == {"committed": 4.0, "aborted": 1.0, "refused": 0.0, "no_candidate": 0.0, "busy": 0.0,
                          "finished_on_source": 0.0, "resumed_on_source": 0.0}
    scaling = {labels["reason"]: value for labels, value in found["llumnix_operator_scaling_events_total"]}
    assert scaling == dict.fromkeys(SCALING_DIRECTION, 0.0)
    for name, series in found.items():
        for labels, value in series:
            assert "instance" not in labels and "namespace" not in labels, name
            assert math.isfinite(value), name


def test_no_load_no_freeness_invalid_spec_and_forgotten_services() -> None:
    metrics = OperatorMetrics()
    metrics.publish("prod", "llama", status(None))
    assert "llumnix_operator_aggregate_freeness" not in samples(metrics)
    metrics.publish("prod", "llama", None)
    assert samples(metrics)["llumnix_operator_spec_valid"] == [(SERVICE, 0.0)]
    assert "llumnix_operator_desired_instances" not in samples(metrics)
    metrics.forget("prod", "llama")
    assert "llumnix_operator_spec_valid" not in samples(metrics)


def test_scaling_events_are_counted_by_direction_and_reason() -> None:
    metrics = OperatorMetrics()
    for reason in ("ScaledUp", "ScaledUp", "Draining", "Released", "InstanceFailed", "SomethingElse"):
        metrics.count_event("prod", "llama", reason)
    counted = {(labels["direction"], labels["reason"]): value
               for labels, value in samples(metrics)["llumnix_operator_scaling_events_total"]}
    assert counted == {("up", "ScaledUp"): 2.0, ("down", "Draining"): 1.0, ("down", "Released"): 1.0,
                       ("replace", "InstanceFailed"): 1.0}


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_endpoint_serves_metrics_and_readiness_from_kopfs_ready_flag() -> None:
    metrics = OperatorMetrics()
    metrics.reconciles.labels("changed").inc()
    ready = threading.Event()
    endpoint = OperatorEndpoint("127.0.0.1", 0, metrics, ready)
    endpoint.start()
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        assert get(base + "/readyz")[0] == 503
        ready.set()
        assert get(base + "/readyz") == (200, "ready\n")
        code, body = get(base + "/metrics")
        assert code == 200 and 'llumnix_operator_reconciles_total{result="changed"} 1.0' in body
        assert get(base + "/nothing")[0] == 404
    finally:
        endpoint.stop()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers_before, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers_before, level


def test_llumnix_operator_is_ready_once_kopf_says_so(
    monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    seen: list[tuple[int, int]] = []
    with socket.socket() as probe:  # a port that was free just now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def fake_run(**kw: Any) -> None:
        before = get(f"http://127.0.0.1:{port}/readyz")[0]
        kw["ready_flag"].set()
        seen.append((before, get(f"http://127.0.0.1:{port}/readyz")[0]))

    monkeypatch.setattr(kopf, "run", fake_run)
    monkeypatch.setattr(handlers, "api_client", lambda: None)
    args: argparse.Namespace = build_parser("operator").parse_args(
        ["operator", "-n", "a", "--metrics-host", "127.0.0.1", "--metrics-port", str(port)]
    )
    assert cli.run(args) == 0
    assert seen == [(503, 200)]


def record(msg: str, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("llumnix.control", logging.INFO, __file__, 1, msg, None, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_log_lines_are_json_naming_the_llmservice_and_namespace() -> None:
    formatter = OperatorJsonFormatter("operator-0")
    kopf_line = json.loads(formatter.format(record(
        "reconciled", k8s_ref={"name": "llama", "namespace": "prod", "kind": "LLMService"}, k8s_skip=False,
        settings=object())))
    assert kopf_line["llmservice"] == "llama" and kopf_line["namespace"] == "prod"
    assert kopf_line["msg"] == "reconciled" and kopf_line["instance"] == "operator-0"
    assert not {"k8s_ref", "k8s_skip", "settings"} & kopf_line.keys()
    with service_context("prod", "llama"):
        loop_line = json.loads(formatter.format(record("started an instance", reason="ScaledUp")))
    assert (loop_line["llmservice"], loop_line["namespace"]) == ("llama", "prod")
    assert loop_line["reason"] == "ScaledUp"
    assert "llmservice" not in json.loads(formatter.format(record("peering")))
