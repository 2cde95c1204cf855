"""The ensurer makes the token Secret once and never rewrites it: an existing Secret is left as it is
(whatever token it holds), and a Secret another operator replica created first is not an error."""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from llumnix.service_spec import ServiceSettings, validate_spec
from llumnix.service_token import ServiceToken
from llumnix_operator.ensure import Ensurer, Outcome
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
