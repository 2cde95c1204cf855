"""LLMService spec: validation messages name the field; defaults are filled; settings map to policies."""

import pytest

from llumnix.service_spec import SpecError, load_service_file, parse_service, validate_spec


def manifest(**spec) -> dict:
    return {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "llama"},
        "spec": {"model": {"name": "llama-7b"}, **spec},
    }


def test_minimal_manifest_gets_every_default() -> None:
    settings = parse_service(manifest())
    spec = settings.spec
    assert settings.name == "llama" and settings.namespace == "default"
    assert spec["engine"]["runtime"] == "vllm"
    assert spec["instances"] == {"min": 1, "max": 16}
    assert spec["dispatch"]["policy"] == "llumnix"
    assert spec["migration"]["intervalMs"] == 100
    assert spec["autoscaling"]["scaleUpBelow"] == 10.0
    assert spec["priorities"]["targetLoadTokens"] == 1600
    assert settings.desired_instances == 1
    assert settings.migration.freeness_threshold == 3.0
    assert settings.autoscaling.max_instances == 16
    assert settings.load_model.high_priority_target_tokens == 1600


def test_given_values_are_kept() -> None:
    settings = parse_service(
        manifest(
            replicas=4,
            instances={"min": 2, "max": 6},
            migration={"select": "shortest"},
            autoscaling={"enabled": True, "scaleUpBelow": 5, "scaleDownAbove": 50},
        )
    )
    assert settings.desired_instances == 4
    assert settings.migration.select == "shortest"
    assert settings.spec["migration"]["enabled"] is True  # default kept beside the given field
    assert settings.autoscaling.scale_down_above == 50


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"dispatch": {"policy": "fastest"}}, "spec.dispatch.policy: 'fastest' is not one of"),
        ({"instances": {"min": 4, "max": 2}}, "spec.instances: instances.min must be <= instances.max"),
        ({"replicas": 5, "instances": {"min": 1, "max": 2}}, "spec: replicas must lie within"),
        ({"instances": {"max": 0}}, "spec.instances.max: 0 is less than the minimum of 1"),
        ({"autoscaling": {"scaleUpBelow": 70}}, "spec.autoscaling: autoscaling.scaleUpBelow must be lower"),
        ({"migration": {"intervalMs": "fast"}}, "spec.migration.intervalMs: 'fast' is not of type 'integer'"),
        ({"router": {"port": 70000}}, "spec.router.port: 70000 is greater than the maximum"),
        ({"model": {}}, "spec.model: 'name' is a required property"),
    ],
)
def test_invalid_specs_name_the_field(spec: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_service(manifest(**spec))
    assert message in str(info.value)


def test_manifest_envelope_errors() -> None:
    with pytest.raises(SpecError, match="apiVersion must be"):
        parse_service({**manifest(), "apiVersion": "v1"})
    with pytest.raises(SpecError, match="kind must be"):
        parse_service({**manifest(), "kind": "Deployment"})
    with pytest.raises(SpecError, match=r"metadata\.name is required"):
        parse_service({**manifest(), "metadata": {}})
    with pytest.raises(SpecError, match="spec must be a mapping"):
        validate_spec(None)


def test_load_service_file(tmp_path) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\n"
        "apiVersion: llumnix.io/v1alpha1\nkind: LLMService\nmetadata: {name: tiny}\n"
        "spec:\n  model: {name: tiny}\n  engine: {runtime: sim}\n"
    )
    assert load_service_file(str(path)).spec["engine"]["runtime"] == "sim"
    (tmp_path / "bad.yaml").write_text("a: [")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_service_file(str(tmp_path / "bad.yaml"))
    with pytest.raises(SpecError, match="cannot read"):
        load_service_file(str(tmp_path / "missing.yaml"))
    (tmp_path / "none.yaml").write_text("kind: Other\n")
    with pytest.raises(SpecError, match="no document of kind LLMService"):
        load_service_file(str(tmp_path / "none.yaml"))
