"""`llumnix operator` maps its flags onto kopf.run; `llumnix drain-instance` drains and waits."""

from __future__ import annotations

import argparse
from typing import Any

import kopf
import pytest

from llumnix.cli import build_parser
from llumnix.v1 import llumlet_pb2
from llumnix_operator import cli, drain_hook, handlers


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["operator", "-n", "a", "-n", "b"],
            {"clusterwide": False, "namespaces": ["a", "b"], "standalone": True, "peering_name": None},
        ),
        (
            ["operator", "--all-namespaces", "--peering", "llumnix"],
            {"clusterwide": True, "namespaces": [], "standalone": False, "peering_name": "llumnix"},
        ),
    ],
)
def test_operator_flags_reach_kopf(argv: list[str], expected: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(handlers, "api_client", lambda: None)
    assert cli.run(parse(*argv, "--metrics-port", "0")) == 0
    assert {k: calls[0][k] for k in expected} == expected


def test_replicas_rank_by_seniority_unless_given_a_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's replicas share their arguments; kopf pauses every replica that sees one of the same
    priority, so by default the one started first outranks the later ones (a restarted replica stands
    by). The peering lifetime (how soon a standby takes over from a dead replica) reaches kopf."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(handlers, "api_client", lambda: None)
    argv = ("operator", "--peering", "llumnix", "--metrics-port", "0")
    for extra in ((), (), ("--priority", "7", "--peering-lifetime", "9")):
        assert cli.run(parse(*argv, *extra)) == 0
    first, second, given = calls
    assert first["priority"] > second["priority"]
    assert given["priority"] == 7 and given["settings"].peering.lifetime == 9
    assert first["settings"].peering.lifetime == 60
    assert cli.seniority_priority(2_000_000_000) > cli.seniority_priority(2_000_001_000)


def test_no_credentials_is_a_clear_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kubernetes

    missing = str(tmp_path / "missing")
    monkeypatch.setenv("KUBECONFIG", missing)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", missing)
    monkeypatch.setattr(kopf, "run", lambda **kw: pytest.fail("kopf must not start"))
    handlers.api_client.cache_clear()
    assert cli.run(parse("operator", "-n", "a")) == 2
    assert "no Kubernetes credentials" in capsys.readouterr().err


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        parse("operator", "-n", "a", "--all-namespaces")


class FakeLlumlet:
    def __init__(self, in_flight: list[int]) -> None:
        self.in_flight = in_flight
        self.draining: list[bool] = []
        self.presented: set[tuple] = set()
        """The metadata of every call (the service token)."""

    def SetDraining(self, request: llumlet_pb2.SetDrainingRequest, timeout: float, metadata: tuple) -> Any:
        self.draining.append(request.draining)
        self.presented.add(metadata)
        return llumlet_pb2.SetDrainingResponse(draining=True, in_flight=self.in_flight.pop(0))

    def Health(self, request: llumlet_pb2.HealthRequest, timeout: float, metadata: tuple) -> Any:
        self.presented.add(metadata)
        return llumlet_pb2.HealthResponse(in_flight=self.in_flight.pop(0) if self.in_flight else 0)


def test_drain_waits_until_no_request_is_left() -> None:
    llumlet = FakeLlumlet([3, 2, 1, 0])
    token = (("authorization", "Bearer t"),)
    assert drain_hook.drain(llumlet, timeout_s=5, poll_interval_s=0.001, metadata=token) == 0  # type: ignore[arg-type]
    assert llumlet.draining == [True] and llumlet.in_flight == []
    assert llumlet.presented == {token}


def test_drain_gives_up_after_the_timeout() -> None:
    llumlet = FakeLlumlet([2] * 1000)
    assert drain_hook.drain(llumlet, timeout_s=0.05, poll_interval_s=0.01) == 2  # type: ignore[arg-type]


def test_drain_of_an_unreachable_llumlet_is_a_no_op(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("drain-instance", "--address", "127.0.0.1:1", "--timeout", "1")
    assert drain_hook.run(args) == 0
    assert "nothing to drain" in capsys.readouterr().err


def test_the_operator_does_not_import_vllm_or_torch() -> None:
    """The operator's image has neither: the handlers must not pull them in (e.g. via the connector)."""
    import subprocess
    import sys

    code = "import sys, llumnix_operator.handlers; print('vllm' in sys.modules or 'torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
