"""The ensurer makes the token Secret once and never rewrites it: an existing Secret is left as it is
(whatever token it holds), and a Secret another operator replica created first is not an error. A
Deployment that already matches is not written; a field the operator no longer sets is removed only
where the caller names it (another writer's fields are left alone)."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from llumnix.service_spec import ServiceSettings, validate_spec
from llumnix.service_token import ServiceToken
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.ensure import Ensurer, Outcome
from llumnix_operator.router import router_deployment, router_fields_to_clear
from llumnix_operator.service_token_secret import token_secret

SETTINGS = ServiceSettings("llama", "prod", validate_spec({"model": {"name": "llama"}}))


class FakeSecrets:
    """CoreV1Api's Secret calls over a dict; records every write."""

    def __init__(self, existing: dict[str, Any] | None = None, race: bool = False) -> None:
        self.existing = existing
        self.race = race
        self.writes: list[str] = []

    def read_namespaced_secret(self, name: str, namespace: str) -> Any:
        if self.existing is None:
            raise kubernetes.client.ApiException(status=404)
        return self.existing

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> Any:
        self.writes.append("create")
        if self.race:  # another replica created it between our read and our create
            raise kubernetes.client.ApiException(status=409)
        self.existing = body
        return body

    def patch_namespaced_secret(self, *args: Any, **kwargs: Any) -> Any:
        self.writes.append("patch")
        raise AssertionError("the token Secret must never be patched")


@pytest.fixture
def ensure(monkeypatch: pytest.MonkeyPatch) -> Any:
    def run(fake: FakeSecrets) -> Outcome:
        for method in ("read_namespaced_secret", "create_namespaced_secret", "patch_namespaced_secret"):
            monkeypatch.setattr(kubernetes.client.CoreV1Api, method,
                                lambda self, *a, _m=method, **k: getattr(fake, _m)(*a, **k))
        return Ensurer(kubernetes.client.ApiClient()).ensure(token_secret(SETTINGS, ServiceToken.generate()))

    return run


def test_a_missing_secret_is_created(ensure: Any) -> None:
    fake = FakeSecrets()
    assert ensure(fake) is Outcome.CREATED and fake.writes == ["create"]


def test_an_existing_secret_is_left_with_its_token(ensure: Any) -> None:
    live = token_secret(SETTINGS, ServiceToken("the-token-pods-hold"))
    fake = FakeSecrets(existing=live)
    assert ensure(fake) is Outcome.UNCHANGED and fake.writes == []
    assert fake.existing is live


def test_a_secret_another_replica_created_first_is_no_error(ensure: Any) -> None:
    fake = FakeSecrets(race=True)
    assert ensure(fake) is Outcome.UNCHANGED and fake.writes == ["create"]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a merge patch: a null removes the key."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeDeployments:
    """AppsV1Api's Deployment calls over one live object; applies merge patches as the API server does."""

    def __init__(self, existing: dict[str, Any]) -> None:
        self.existing = existing
        self.patches: list[dict[str, Any]] = []

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any:
        return self.existing

    def patch_namespaced_deployment(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> Any:
        self.patches.append(body)
        self.existing = merge_patch(self.existing, body)
        return self.existing


def ensure_deployment(monkeypatch: pytest.MonkeyPatch, fake: FakeDeployments, desired: dict[str, Any],
                      absent: list[tuple[str, ...]]) -> Outcome:
    for method in ("read_namespaced_deployment", "patch_namespaced_deployment"):
        monkeypatch.setattr(kubernetes.client.AppsV1Api, method,
                            lambda self, *a, _m=method, **k: getattr(fake, _m)(*a, **k))
    return Ensurer(kubernetes.client.ApiClient()).ensure(desired, absent)


def router(**router_spec: Any) -> tuple[ServiceSettings, dict[str, Any]]:
    """Settings with `router_spec` and the router Deployment built from them."""
    spec = validate_spec({"model": {"name": "llama"}, "router": router_spec})
    settings = ServiceSettings("llama", "prod", spec)
    return settings, router_deployment(settings, BuildConfig())


AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}


def test_a_matching_deployment_is_not_written(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, desired = router(affinity=AFFINITY, nodeSelector={"pool": "cpu"})
    fake = FakeDeployments(desired)
    assert ensure_deployment(monkeypatch, fake, desired, router_fields_to_clear(settings, None)) is (
        Outcome.UNCHANGED)
    assert fake.patches == []


def test_a_router_placement_field_removed_from_the_spec_is_removed_from_the_deployment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, live = router(affinity=AFFINITY, nodeSelector={"pool": "cpu"})
    settings, desired = router(nodeSelector={"pool": "cpu"})
    old_spec = {"model": {"name": "llama"}, "router": {"affinity": AFFINITY, "nodeSelector": {"pool": "cpu"}}}
    absent = router_fields_to_clear(settings, old_spec)
    assert absent == [("spec", "template", "spec", "affinity")]
    fake = FakeDeployments(live)
    assert ensure_deployment(monkeypatch, fake, desired, absent) is Outcome.PATCHED
    assert fake.patches[0]["spec"]["template"]["spec"]["affinity"] is None  # null: remove it
    pod_spec = fake.existing["spec"]["template"]["spec"]
    assert "affinity" not in pod_spec and pod_spec["nodeSelector"] == {"pool": "cpu"}
    # Done once: the next reconcile (or a restart, which has no previous spec) writes nothing.
    assert ensure_deployment(monkeypatch, fake, desired, absent) is Outcome.UNCHANGED
    assert ensure_deployment(monkeypatch, fake, desired, router_fields_to_clear(settings, None)) is (
        Outcome.UNCHANGED)
    assert len(fake.patches) == 1


def test_placement_another_writer_added_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, desired = router()
    live = merge_patch(desired, {"spec": {"template": {"spec": {"tolerations": [{"key": "spot"}]}}}})
    fake = FakeDeployments(live)
    # The spec never set router tolerations: nothing to clear, and the live object covers the desired one.
    absent = router_fields_to_clear(settings, {"model": {"name": "llama"}, "router": {"port": 8000}})
    assert ensure_deployment(monkeypatch, fake, desired, absent) is Outcome.UNCHANGED
    assert fake.patches == []
