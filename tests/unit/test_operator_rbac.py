"""The operator's Role is least privilege: every (API group, resource, verb) it grants is one the
operator uses, and every one the operator uses is granted. "Used" is read off the code: each
Kubernetes client call in operator/*.py, the ensurer's calls per kind it manages, what the workloads'
Role grants (RBAC lets a Role grant only what its creator holds), and kopf's own calls."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from llumnix.service_spec import API_GROUP, PLURAL, ServiceSettings, validate_spec
from llumnix_operator.access import role
from llumnix_operator.ensure import _KINDS

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (dev extra)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/llumnix"
Grant = tuple[str, str, str]  # (API group, resource, verb)

VERBS = {"read": "get", "list": "list", "create": "create", "patch": "patch", "delete": "delete",
         "replace": "update"}
CLIENT_METHOD = re.compile(r"^(read|list|create|patch|delete|replace)_namespaced_(\w+)$")
RESOURCES = {  # the official client's method suffix -> (group, resource)
    "pod": ("", "pods"),
    "secret": ("", "secrets"),
    "service": ("", "services"),
    "service_account": ("", "serviceaccounts"),
    "deployment": ("apps", "deployments"),
    "network_policy": ("networking.k8s.io", "networkpolicies"),
    "pod_disruption_budget": ("policy", "poddisruptionbudgets"),
    "role": ("rbac.authorization.k8s.io", "roles"),
    "role_binding": ("rbac.authorization.k8s.io", "rolebindings"),
    "custom_object": (API_GROUP, PLURAL),  # the only custom objects the operator writes
    "custom_object_status": (API_GROUP, f"{PLURAL}/status"),
}
# kopf's own calls (kopf/_cogs/clients: watching is list + watch, progress annotations and finalizers
# are patches, events are posted; replicas coordinate through a peering object).
KOPF = {(API_GROUP, PLURAL, "list"), (API_GROUP, PLURAL, "watch"), (API_GROUP, PLURAL, "patch"),
        ("", "events", "create")}
KOPF_PEERING_VERBS = ("get", "list", "watch", "patch")
KOPF_CLUSTERWIDE = {("", "namespaces", "list"), ("", "namespaces", "watch"),
                    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                    ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}


def client_calls() -> set[Grant]:
    """Every `<verb>_namespaced_<kind>` the operator's code calls by name."""
    used = set()
    for path in sorted((ROOT / "operator").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and (match := CLIENT_METHOD.match(node.attr)):
                verb, suffix = match.groups()
                assert suffix in RESOURCES, f"{path.name}: {node.attr} calls a kind this test does not know"
                used.add((*RESOURCES[suffix], VERBS[verb]))
    return used


def ensurer_calls() -> set[Grant]:
    """Ensurer.ensure: read, create, and patch unless the kind is made once."""
    used = set()
    for kind in _KINDS.values():
        group, resource = RESOURCES[kind.methods.removeprefix("namespaced_")]
        used |= {(group, resource, "get"), (group, resource, "create")}
        if not kind.create_only:
            used.add((group, resource, "patch"))
    return used


def delegated() -> set[Grant]:
    settings = ServiceSettings("s", "ns", validate_spec({"model": {"name": "m"}}))
    return {(group, resource, verb) for rule in role(settings)["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def used(all_namespaces: bool) -> set[Grant]:
    peering = "clusterkopfpeerings" if all_namespaces else "kopfpeerings"
    kopf = KOPF | {("kopf.dev", peering, verb) for verb in KOPF_PEERING_VERBS}
    if all_namespaces:
        kopf |= KOPF_CLUSTERWIDE
    return client_calls() | ensurer_calls() | delegated() | kopf


def granted(all_namespaces: bool) -> set[Grant]:
    chart = helm.Chart.load(str(CHART))
    try:
        rendered = chart.render({"operator": {"allNamespaces": all_namespaces}}, name="rel",
                                namespace="llumnix")
    finally:
        chart.close()
    kind = "ClusterRole" if all_namespaces else "Role"
    rules = next(doc for path, text in rendered.items() if not path.endswith("NOTES.txt")
                 for doc in yaml.safe_load_all(text) if doc and doc["kind"] == kind)["rules"]
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_scan_sees_the_calls_it_must() -> None:
    # Guards the scan itself: these calls exist in operator/*.py today.
    assert {("", "pods", "list"), ("", "pods", "create"), ("", "pods", "delete"), ("", "secrets", "get"),
            (API_GROUP, f"{PLURAL}/status", "patch")} <= client_calls()
    assert ("", "secrets", "create") in ensurer_calls() and ("", "secrets", "patch") not in ensurer_calls()


@pytest.mark.parametrize("all_namespaces", [False, True], ids=["namespaced", "cluster-wide"])
def test_the_role_grants_exactly_what_the_operator_uses(all_namespaces: bool) -> None:
    needed, given = used(all_namespaces), granted(all_namespaces)
    assert needed - given == set(), "used but not granted"
    assert given - needed == set(), "granted but never used"
