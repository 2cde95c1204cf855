"""The CRD is generated from the one spec definition, is current in the chart, and validates CRs."""

import importlib.util
from pathlib import Path

import jsonschema
import pytest
import yaml

from llumnix.service_spec import CROSS_FIELD_RULES
from llumnix_operator.crd import crd_manifest

ROOT = Path(__file__).resolve().parents[2]


def load_gen_crd():
    spec = importlib.util.spec_from_file_location("gen_crd", ROOT / "scripts/gen_crd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_crd_is_current() -> None:
    gen = load_gen_crd()
    assert gen.CRD_PATH.read_text() == gen.render(), "run: .venv/bin/python scripts/gen_crd.py"


def crd_schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def cr(**spec) -> dict:
    return {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "x"},
        "spec": {"model": {"name": "m"}, **spec},
    }


def test_valid_resources_pass_the_crd_schema() -> None:
    validator = jsonschema.Draft7Validator(crd_schema())
    for resource in (cr(), cr(replicas=3, instances={"min": 1, "max": 4}, dispatch={"policy": "infaas++"})):
        assert list(validator.iter_errors(resource)) == []


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"dispatch": {"policy": "x"}}, ["spec", "dispatch", "policy"]),
        ({"router": {"replicas": 0}}, ["spec", "router", "replicas"]),
        ({"migration": {"enabled": "yes"}}, ["spec", "migration", "enabled"]),
    ],
)
def test_invalid_resources_fail_the_crd_schema_at_the_field(spec: dict, field: list[str]) -> None:
    errors = list(jsonschema.Draft7Validator(crd_schema()).iter_errors(cr(**spec)))
    assert [list(e.path) for e in errors] == [field]


def test_cross_field_rules_are_attached_as_cel() -> None:
    spec_schema = crd_schema()["properties"]["spec"]
    rules = [v["rule"] for v in spec_schema["x-kubernetes-validations"]]
    rules += [v["rule"] for v in spec_schema["properties"]["instances"]["x-kubernetes-validations"]]
    rules += [v["rule"] for v in spec_schema["properties"]["autoscaling"]["x-kubernetes-validations"]]
    assert sorted(rules) == sorted(rule.cel for rule in CROSS_FIELD_RULES)


def test_scale_subresource_and_printer_columns() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready",
        "Desired",
        "Freeness",
        "Headroom",
        "Migrations",
        "Age",
    ]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Freeness"]["jsonPath"] == ".status.aggregateFreeness"  # what the autoscaler acts on
    # kubectl's default view shows the columns of priority 0: the human-readable Headroom, not the raw number
    assert [name for name, c in columns.items() if c.get("priority", 0) > 0] == ["Freeness"]
    assert yaml.safe_load(yaml.safe_dump(crd_manifest())) == crd_manifest()
