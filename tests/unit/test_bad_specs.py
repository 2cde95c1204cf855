"""A table of LLMService mistakes a user can make, each refused with the field's name by both places
that read a spec: the API server (the CRD's schema and its CEL rules, evaluated here with cel-python
as the API server would) and `parse_service` (local mode, and the operator's status conditions).

docs/reliability.md shows this table; a row added here is a mistake the product now catches."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
import pytest

from llumnix.service_spec import SpecError, apply_defaults, parse_service
from llumnix_operator import naming
from llumnix_operator.crd import crd_manifest

SCHEMA = "schema"
"""The CRD's OpenAPI schema refuses it at the field (type, enum, range, pattern, required)."""
CEL = "cel"
"""The schema passes it; a CEL rule attached to the field refuses it."""
UNKNOWN = "unknown"
"""A field the CRD does not define: kubectl's strict field validation refuses it (the API server would
otherwise drop it silently)."""

# (what the user wrote, merged into a valid CR; the field named in the error; who refuses it)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("no model", {"spec": {"model": None}}, "spec.model", SCHEMA),
    ("empty model name", {"spec": {"model": {"name": ""}}}, "spec.model.name", SCHEMA),
    ("unknown engine runtime", {"spec": {"engine": {"runtime": "tensorrt"}}}, "spec.engine.runtime", SCHEMA),
    (
        "engine args as one string",
        {"spec": {"engine": {"args": "--max-model-len 4096"}}},
        "spec.engine.args",
        SCHEMA,
    ),
    (
        "GPU share above 1",
        {"spec": {"engine": {"gpuMemoryUtilization": 1.5}}},
        "spec.engine.gpuMemoryUtilization",
        SCHEMA,
    ),
    ("block size 0", {"spec": {"engine": {"blockSize": 0}}}, "spec.engine.blockSize", SCHEMA),
    (
        "negative GPUs",
        {"spec": {"engine": {"resources": {"gpus": -1}}}},
        "spec.engine.resources.gpus",
        SCHEMA,
    ),
    (
        "memory with a space",
        {"spec": {"engine": {"resources": {"memory": "32 GB"}}}},
        "spec.engine.resources.memory",
        SCHEMA,
    ),
    (
        "CPU in words",
        {"spec": {"router": {"resources": {"cpu": "half"}}}},
        "spec.router.resources.cpu",
        SCHEMA,
    ),
    ("negative replicas", {"spec": {"replicas": -1}}, "spec.replicas", SCHEMA),
    ("replicas as text", {"spec": {"replicas": "3"}}, "spec.replicas", SCHEMA),
    ("min above max", {"spec": {"instances": {"min": 5, "max": 2}}}, "spec.instances", CEL),
    ("replicas above max", {"spec": {"replicas": 9, "instances": {"min": 1, "max": 4}}}, "spec", CEL),
    ("replicas below min", {"spec": {"replicas": 1, "instances": {"min": 2, "max": 4}}}, "spec", CEL),
    (
        "unknown dispatch policy",
        {"spec": {"dispatch": {"policy": "fastest"}}},
        "spec.dispatch.policy",
        SCHEMA,
    ),
    ("top-k 0", {"spec": {"dispatch": {"topK": 0}}}, "spec.dispatch.topK", SCHEMA),
    ("migration on as text", {"spec": {"migration": {"enabled": "yes"}}}, "spec.migration.enabled", SCHEMA),
    (
        "migration interval 1 ms",
        {"spec": {"migration": {"intervalMs": 1}}},
        "spec.migration.intervalMs",
        SCHEMA,
    ),
    (
        "unknown KV transport",
        {"spec": {"migration": {"transport": "rdma"}}},
        "spec.migration.transport",
        SCHEMA,
    ),
    (
        "unknown request selection",
        {"spec": {"migration": {"select": "random"}}},
        "spec.migration.select",
        SCHEMA,
    ),
    (
        "no concurrent migrations",
        {"spec": {"migration": {"maxConcurrentPerInstance": 0}}},
        "spec.migration.maxConcurrentPerInstance",
        SCHEMA,
    ),
    (
        "scale-up bound above scale-down bound",
        {"spec": {"autoscaling": {"scaleUpBelow": 50, "scaleDownAbove": 20}}},
        "spec.autoscaling",
        CEL,
    ),
    (
        "autoscaling interval 0",
        {"spec": {"autoscaling": {"intervalSeconds": 0}}},
        "spec.autoscaling.intervalSeconds",
        SCHEMA,
    ),
    (
        "negative start-up grace",
        {"spec": {"autoscaling": {"startupGraceSeconds": -5}}},
        "spec.autoscaling.startupGraceSeconds",
        SCHEMA,
    ),
    (
        "priority target 0 tokens",
        {"spec": {"priorities": {"targetLoadTokens": 0}}},
        "spec.priorities.targetLoadTokens",
        SCHEMA,
    ),
    ("router port 70000", {"spec": {"router": {"port": 70000}}}, "spec.router.port", SCHEMA),
    (
        "router Service type Ingress",
        {"spec": {"router": {"serviceType": "Ingress"}}},
        "spec.router.serviceType",
        SCHEMA,
    ),
    ("no router", {"spec": {"router": {"replicas": 0}}}, "spec.router.replicas", SCHEMA),
    (
        "router spread as one constraint, not a list",
        {"spec": {"router": {"topologySpreadConstraints": {"maxSkew": 1, "topologyKey": "zone"}}}},
        "spec.router.topologySpreadConstraints",
        SCHEMA,
    ),
    (
        "engine affinity as a node name",
        {"spec": {"engine": {"resources": {"affinity": "gpu-node-1"}}}},
        "spec.engine.resources.affinity",
        SCHEMA,
    ),
    ("misspelt replicas", {"spec": {"replica": 3}}, "spec.replica", UNKNOWN),
    ("misspelt nested field", {"spec": {"migration": {"treshold": 2}}}, "spec.migration.treshold", UNKNOWN),
    ("name too long for its Services", {"metadata": {"name": "a" * 55}}, "metadata.name", CEL),
    ("name with a dot", {"metadata": {"name": "llama.7b"}}, "metadata.name", CEL),
    ("name in capitals", {"metadata": {"name": "Llama"}}, "metadata.name", CEL),
]

VALID = {
    "apiVersion": "llumnix.io/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": "svc"},
    "spec": {"model": {"name": "m"}},
}


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` laid over it; a None in `patch` removes the key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def openapi_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def schema_errors(resource: dict[str, Any]) -> list[str]:
    """Where the CRD's schema refuses `resource`, as dotted field paths."""
    errors = jsonschema.Draft7Validator(openapi_schema()).iter_errors(resource)
    paths = []
    for error in errors:
        path = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "required":  # jsonschema reports a missing field at its parent
            path = ".".join(
                filter(None, [path, *[r for r in error.validator_value if r not in error.instance]])
            )
        paths.append(path)
    return paths


def cel_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """Every (field path, CEL rule) of the schema, the root's path being ""."""
    rules = [(path, rule["rule"]) for rule in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        rules += cel_rules(sub, f"{path}.{key}".lstrip("."))
    return rules


def cel_failures(resource: dict[str, Any]) -> list[str]:
    """The fields whose CEL rules `resource` breaks, after the API server's defaulting."""
    defaulted = apply_defaults(openapi_schema(), copy.deepcopy(resource))
    env = celpy.Environment()
    failed = []
    for path, rule in cel_rules(openapi_schema()):
        node: Any = defaulted
        for key in filter(None, path.split(".")):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue  # a rule on an absent field is not evaluated
        result = env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(node)})
        if not (isinstance(result, celpy.celtypes.BoolType) and result):  # false, or an evaluation error
            failed.append(path or "metadata.name")
    return failed


def defined_in_crd(field: str) -> bool:
    node = openapi_schema()
    for key in field.split("."):
        node = node.get("properties", {}).get(key)
        if node is None:
            return False
    return True


def test_the_valid_resource_passes_everywhere() -> None:
    assert schema_errors(VALID) == []
    assert cel_failures(VALID) == []
    parse_service(VALID)


@pytest.mark.parametrize(("patch", "field", "refused_by"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_resource_is_refused_with_its_field(patch: dict[str, Any], field: str, refused_by: str) -> None:
    resource = merged(VALID, patch)
    if refused_by == SCHEMA:
        assert schema_errors(resource) == [field]
    elif refused_by == CEL:
        assert schema_errors(resource) == []
        assert cel_failures(resource) == [field]
    else:
        assert not defined_in_crd(field)
    with pytest.raises(SpecError) as refused:
        parse_service(resource)
    assert str(refused.value).startswith(field if field != "spec" else "spec:"), str(refused.value)


def test_an_autoscaled_service_may_narrow_its_bounds_past_the_published_count() -> None:
    """With built-in autoscaling on, spec.replicas is the count the operator publishes: lowering
    instances.max below it (or raising min above it) is the user's way to shrink (or grow) the
    service, accepted by the API server and by the operator, which then clamps the count."""
    for bounds in ({"min": 1, "max": 2}, {"min": 4, "max": 6}):
        autoscaled = {"replicas": 3, "instances": bounds, "autoscaling": {"enabled": True}}
        resource = merged(VALID, {"spec": autoscaled})
        assert schema_errors(resource) == [] and cel_failures(resource) == []
        assert parse_service(resource).spec.replicas == 3
        without_autoscaling = merged(resource, {"spec": {"autoscaling": {"enabled": False}}})
        assert cel_failures(without_autoscaling) == ["spec"]
        with pytest.raises(SpecError, match="replicas must lie within"):
            parse_service(without_autoscaling)


def test_a_misspelt_field_gets_a_suggestion() -> None:
    with pytest.raises(SpecError, match="did you mean 'replicas'"):
        parse_service(merged(VALID, {"spec": {"replica": 3}}))


def test_the_longest_name_allowed_gives_valid_object_names() -> None:
    name = "a" * 54
    parse_service(merged(VALID, {"metadata": {"name": name}}))
    for derived in (naming.llumlets_service_name(name), naming.router_name(name)):
        assert len(derived) <= 63, derived  # Service names are DNS-1035 labels
