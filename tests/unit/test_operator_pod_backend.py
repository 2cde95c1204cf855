"""Pods -> the instances the control loop sees, and the create-or-patch comparison."""

from __future__ import annotations

import pytest

from llumnix.control.backend import InstancePhase
from llumnix.service_spec import ServiceSettings, validate_spec
from llumnix_operator.ensure import covers
from llumnix_operator.pod_backend import instance_from_pod, owned_by


def pod(status: dict | None = None, **meta: object) -> dict:
    return {
        "metadata": {
            "name": "llama-engine-abcde",
            "creationTimestamp": "2027-01-15T08:00:00Z",
            "annotations": {"llumnix.io/template-hash": "h1"},
            **meta,
        },
        "status": status or {},
    }


RUNNING_READY = {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}


def test_ready_pod_is_a_ready_instance_at_its_llumlet_address() -> None:
    info = instance_from_pod(pod(RUNNING_READY))
    assert info.phase is InstancePhase.READY
    assert info.address == "10.0.0.7:50051"
    assert info.instance_id == "llama-engine-abcde"
    assert info.created_at == 1_800_000_000.0
    assert info.template_hash == "h1"


@pytest.mark.parametrize(
    ("status", "meta", "phase"),
    [
        ({}, {}, InstancePhase.STARTING),
        ({"phase": "Pending"}, {}, InstancePhase.STARTING),
        (
            {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "False"}]},
            {},
            InstancePhase.STARTING,
        ),
        (RUNNING_READY, {"deletionTimestamp": "2027-01-15T08:01:00Z"}, InstancePhase.TERMINATING),
        ({"phase": "Failed", "message": "OOMKilled"}, {}, InstancePhase.FAILED),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "engine",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}},
                    }
                ],
            },
            {},
            InstancePhase.FAILED,
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [
                    {"name": "engine", "state": {"waiting": {"reason": "ContainerCreating"}}}
                ],
            },
            {},
            InstancePhase.STARTING,
        ),
    ],
)
def test_pod_phases(status: dict, meta: dict, phase: InstancePhase) -> None:
    assert instance_from_pod(pod(status, **meta)).phase is phase


def test_failure_message_names_the_container() -> None:
    info = instance_from_pod(
        pod(
            {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": "llumlet",
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m"}},
                    }
                ],
            }
        )
    )
    assert info.message == "container llumlet: CrashLoopBackOff back-off 5m"


def test_only_pods_owned_by_this_service_count() -> None:
    settings = ServiceSettings("llama", "default", validate_spec({"model": {"name": "m"}}))
    labels = {"llumnix.io/service": "llama", "app.kubernetes.io/component": "engine"}
    mine = pod(labels=labels, ownerReferences=[{"uid": "u1"}])
    assert owned_by(mine, settings, "u1")
    assert not owned_by(mine, settings, "u2")  # an older LLMService of the same name
    assert not owned_by(
        pod(labels={**labels, "llumnix.io/service": "other"}, ownerReferences=[{"uid": "u1"}]), settings, "u1"
    )


def test_covers_compares_only_desired_fields() -> None:
    desired = {"spec": {"ports": [{"port": 80}], "selector": {"a": "1"}}}
    live = {
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}], "selector": {"a": "1"}, "clusterIP": "10.1.1.1"},
        "status": {},
    }
    assert covers(live, desired)
    assert not covers(live, {"spec": {"ports": [{"port": 81}]}})
    assert not covers(live, {"spec": {"ports": [{"port": 80}, {"port": 81}]}})
    assert not covers({"spec": {}}, {"spec": {"replicas": 2}})
