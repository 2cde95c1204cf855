"""`.status` from the control loop's ServiceStatus: values, conditions with reasons, and the result
validates against the CRD's own status schema."""

from __future__ import annotations

import jsonschema

from llumnix.control.status import InstanceStatus, ScalingDecision, ServiceStatus
from llumnix_operator.crd import crd_manifest
from llumnix_operator.status import invalid_spec_conditions, service_status, status_changed

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def status_schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def instance(name: str, phase: str = "ready", freeness: float | None = 20.0, **kw: object) -> InstanceStatus:
    return InstanceStatus(name, phase, f"{name}:50051", freeness, **kw)  # type: ignore[arg-type]


def build(service: ServiceStatus, previous: dict | None = None, now: float = NOW) -> dict:
    status = service_status(service, generation=3, previous=previous or {}, now=now)
    jsonschema.Draft7Validator(status_schema()).validate(status)
    return status


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_steady_service() -> None:
    service = ServiceStatus(
        "llama",
        2,
        (instance("a", running=3, waiting=1), instance("b", freeness=40.0)),
        aggregate_freeness=25.0,
        migrations={"committed": 7, "aborted": 1, "error": 2, "refused": 5},
        last_decision=ScalingDecision("scale-up", "aggregate freeness 8 < 10", NOW - 60),
    )
    status = build(service)
    assert status["observedGeneration"] == 3
    assert status["replicas"] == 2
    assert status["selector"] == "llumnix.io/service=llama,app.kubernetes.io/component=engine"
    assert status["instances"] == {"ready": 2, "desired": 2}
    # the autoscaler's signal, not the mean of the instances' (20, 40)
    assert status["aggregateFreeness"] == 25.0
    assert status["headroom"] == "25.0 blocks/request"  # no load has told the block size yet
    assert status["migrations"] == {"completed": 7, "aborted": 3}
    assert status["instanceSummaries"][0] == {
        "name": "a",
        "phase": "ready",
        "freeness": 20.0,
        "running": 3,
        "waiting": 1,
        "draining": False,
    }
    assert status["lastScaling"] == {
        "time": "2027-01-15T07:59:00Z",
        "action": "scale-up",
        "reason": "aggregate freeness 8 < 10",
    }
    assert conditions(status) == {
        "Ready": ("True", "AllInstancesServing"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "Healthy"),
    }
    assert {c["lastTransitionTime"] for c in status["conditions"]} == {"2027-01-15T08:00:00Z"}


def test_the_last_decision_carries_the_aggregate_freeness_it_was_taken_at() -> None:
    decision = ScalingDecision("drain", "aggregate freeness 70 without it > 60", NOW - 5, "b", 81.256)
    service = ServiceStatus("llama", 2, (instance("a"), instance("b")), aggregate_freeness=80.0,
                            last_decision=decision)
    assert build(service)["lastScaling"] == {
        "time": "2027-01-15T07:59:55Z",
        "action": "drain",
        "instance": "b",
        "reason": "aggregate freeness 70 without it > 60",
        "aggregateFreeness": 81.26,
    }


def test_scaling_up_with_a_failed_instance() -> None:
    service = ServiceStatus(
        "llama",
        3,
        (instance("a"), instance("b", "starting", None), instance("c", "failed", None)),
        aggregate_freeness=20.0,
    )
    status = build(service)
    assert status["instances"] == {"ready": 1, "desired": 3}
    assert conditions(status) == {
        "Ready": ("True", "PartiallyServing"),
        "Progressing": ("True", "ScalingUp"),
        "Degraded": ("True", "InstanceFailed"),
    }
    assert "freeness" not in status["instanceSummaries"][1]  # no load yet


def test_draining_instance_is_reported_and_reports_no_infinite_freeness() -> None:
    service = ServiceStatus(
        "llama",
        1,
        (instance("a"), instance("b", freeness=float("-inf"), draining=True)),
        aggregate_freeness=20.0,
    )
    status = build(service)
    assert conditions(status)["Progressing"] == ("True", "Draining")
    assert status["aggregateFreeness"] == 20.0 and status["headroom"] == "idle"
    assert "freeness" not in status["instanceSummaries"][1] and status["instanceSummaries"][1]["draining"]


def test_successor_starting_is_replacing() -> None:
    service = ServiceStatus(
        "llama", 1, (instance("a"), instance("b", "starting", None)), aggregate_freeness=20.0
    )
    assert conditions(build(service))["Progressing"] == ("True", "Replacing")


def test_no_instance_serving() -> None:
    status = build(ServiceStatus("llama", 1, (), aggregate_freeness=None))
    assert conditions(status)["Ready"] == ("False", "NoInstanceServing")
    assert "aggregateFreeness" not in status and "headroom" not in status


def test_headroom_says_what_the_aggregate_freeness_means() -> None:
    busy = ServiceStatus("llama", 1, (instance("a", running=2, block_size=16),), aggregate_freeness=12.5)
    assert build(busy)["headroom"] == "200 decode steps"
    idle = ServiceStatus("llama", 1, (instance("a", freeness=32759.0, block_size=16),),
                         aggregate_freeness=32759.0)
    assert build(idle)["headroom"] == "idle" and build(idle)["aggregateFreeness"] == 32759.0


def test_transition_time_kept_while_a_condition_holds() -> None:
    steady = ServiceStatus("llama", 1, (instance("a"),), aggregate_freeness=20.0)
    first = build(steady)
    later = build(steady, previous=first, now=NOW + 600)
    assert later["conditions"] == first["conditions"]
    assert not status_changed(later, first)
    failing = ServiceStatus("llama", 1, (instance("a", "failed", None),), aggregate_freeness=None)
    changed = build(failing, previous=first, now=NOW + 600)
    assert status_changed(changed, first)
    ready = next(c for c in changed["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2027-01-15T08:10:00Z"


def test_invalid_spec_conditions_name_the_problem() -> None:
    conds = invalid_spec_conditions("spec.instances: instances.min must be <= instances.max")
    assert {c["type"]: c["reason"] for c in conds} == {
        "Ready": "InvalidSpec",
        "Progressing": "InvalidSpec",
        "Degraded": "InvalidSpec",
    }
    assert all("instances.min" in c["message"] for c in conds)


def test_a_restarted_loop_keeps_counts_and_the_last_decision() -> None:
    before = build(
        ServiceStatus(
            "llama",
            1,
            (instance("a"),),
            aggregate_freeness=20.0,
            migrations={"committed": 4},
            last_decision=ScalingDecision("drain", "too free", NOW - 5, "b"),
        )
    )
    fresh_loop = ServiceStatus(
        "llama", 1, (instance("a"),), aggregate_freeness=20.0, migrations={"committed": 1}
    )
    after = service_status(
        fresh_loop, generation=3, previous=before, now=NOW + 1, migrations_before=before["migrations"]
    )
    assert after["migrations"] == {"completed": 5, "aborted": 0}
    assert (
        after["lastScaling"]
        == before["lastScaling"]
        == {"time": "2027-01-15T07:59:55Z", "action": "drain", "instance": "b", "reason": "too free"}
    )


def test_load_figures_alone_are_not_a_state_change() -> None:
    before = build(ServiceStatus("llama", 1, (instance("a", running=1),), aggregate_freeness=20.0))
    busier = build(
        ServiceStatus("llama", 1, (instance("a", freeness=5.0, running=4),), aggregate_freeness=5.0)
    )
    assert status_changed(busier, before)
    assert not status_changed(busier, before, with_load=False)
    failed = build(ServiceStatus("llama", 1, (instance("a", "failed", None),), aggregate_freeness=None))
    assert status_changed(failed, before, with_load=False)
