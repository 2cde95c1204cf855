"""Rolling replacement and spec handling in the per-service daemon (no API calls are made here)."""

from __future__ import annotations

import kubernetes
import pytest

from llumnix.control.backend import InstanceInfo, InstancePhase
from llumnix.control.status import ControlEvent
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.service_runner import ServiceRunner


class FakeLoop:
    def __init__(self, instances: list[InstanceInfo]) -> None:
        self.instances = {i.instance_id: i for i in instances}
        self.draining: dict[str, object] = {}
        self.settings = None

    async def drain(self, instance_id: str) -> None:
        self.draining[instance_id] = "admin"

    def update_settings(self, settings: object) -> None:
        self.settings = settings


def runner(spec: dict) -> tuple[ServiceRunner, list[ControlEvent]]:
    body = {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "llama", "namespace": "default", "uid": "u1", "generation": 1},
        "spec": spec,
    }
    events: list[ControlEvent] = []
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host="http://127.0.0.1:1"))
    r = ServiceRunner(body, api, BuildConfig(), on_event=events.append)
    r.read_spec()
    return r, events


def info(name: str, template: str, phase: InstancePhase = InstancePhase.READY) -> InstanceInfo:
    return InstanceInfo(name, phase, f"{name}:50051", 0.0, template_hash=template)


SPEC = {"model": {"name": "m"}, "engine": {"runtime": "sim"}}


async def test_one_stale_pod_is_drained_at_a_time() -> None:
    r, events = runner(SPEC)
    current = r.current_template_hash()
    loop = FakeLoop([info("a", current), info("b", "old"), info("c", "old")])
    r.loop = loop  # type: ignore[assignment]
    assert await r.roll_one() == "b"
    assert list(loop.draining) == ["b"]
    assert [(e.reason, e.instance_id) for e in events] == [("RollingUpdate", "b")]
    counted = r.metrics.registry.get_sample_value(
        "llumnix_operator_scaling_events_total",
        {"llmservice_namespace": "default", "llmservice": "llama", "direction": "replace",
         "reason": "RollingUpdate"})
    assert counted == 1.0
    assert await r.roll_one() is None  # b still draining: c waits
    del loop.draining["b"]
    loop.instances["d"] = info("d", current, InstancePhase.STARTING)
    assert await r.roll_one() is None  # b's successor still starting
    loop.instances["d"] = info("d", current)
    del loop.instances["b"]
    assert await r.roll_one() == "c"


async def test_nothing_to_roll_when_templates_match() -> None:
    r, _ = runner(SPEC)
    r.loop = FakeLoop([info("a", r.current_template_hash())])  # type: ignore[assignment]
    assert await r.roll_one() is None


@pytest.mark.parametrize("bad", [{"instances": {"min": 3, "max": 2}}, {"dispatch": {"policy": "fastest"}}])
def test_an_invalid_spec_keeps_the_last_valid_settings(bad: dict) -> None:
    r, _ = runner({**SPEC, "replicas": 2, "instances": {"min": 1, "max": 4}})
    loop = FakeLoop([])
    r.loop = loop  # type: ignore[assignment]
    valid = r.settings
    r.body["spec"] = {**r.body["spec"], **bad}  # type: ignore[index]
    r.read_spec()
    assert r.settings is valid and r.spec_error is not None and loop.settings is None
    status = r.desired_status()
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Degraded"] == "InvalidSpec"
    r.body["spec"] = {**SPEC, "replicas": 3, "instances": {"min": 1, "max": 4}}  # type: ignore[index]
    r.read_spec()
    assert r.spec_error is None and loop.settings is r.settings and r.settings.desired_instances == 3
