"""LLMService spec: validation messages name the field; defaults are filled; settings map to policies."""

import pytest

from llumnix.service_spec import (
    InstancesSpec,
    ModelSource,
    PodPlacement,
    SpecError,
    load_service_file,
    parse_service,
    validate_spec,
)

AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}


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
    assert spec.engine.runtime == "vllm"
    assert spec.instances == InstancesSpec(min=1, max=16)
    assert spec.replicas is None
    assert spec.dispatch.policy == "llumnix"
    assert spec.migration.interval_ms == 100
    assert spec.migration.transport == "auto"
    assert spec.autoscaling.scale_up_below == 10.0
    assert spec.priorities.target_load_tokens == 1600
    assert spec.model.source == ModelSource(pvc=None, sub_path=None)
    assert settings.desired_instances == 1
    assert settings.migration.freeness_threshold == 3.0
    assert settings.autoscaling.max_instances == 16
    assert settings.load_model.high_priority_target_tokens == 1600
    assert settings.llumlet_args == ["--high-priority-target-tokens", "1600",
                                     "--migration-select", "last-come", "--max-concurrent-migrations", "1",
                                     "--migration-transport", "auto"]


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
    assert settings.spec.migration.enabled is True  # default kept beside the given field
    assert settings.autoscaling.scale_down_above == 50


def test_a_migration_threshold_above_the_destination_bound_raises_the_bound() -> None:
    config = parse_service(manifest(migration={"freenessThreshold": 25})).migration
    assert config.freeness_threshold == 25 and config.destination_freeness == 25


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_the_migration_transport_reaches_the_llumlet_flags(transport: str) -> None:
    args = parse_service(manifest(migration={"transport": transport})).llumlet_args
    assert args[args.index("--migration-transport") + 1] == transport


def test_an_unknown_migration_transport_is_refused() -> None:
    with pytest.raises(SpecError, match=r"spec\.migration\.transport: 'rdma' is not one of"):
        parse_service(manifest(migration={"transport": "rdma"}))


def test_every_given_field_reaches_the_typed_spec() -> None:
    spec = parse_service(
        manifest(
            model={"name": "llama-7b", "path": "llama-2-7b", "source": {"pvc": "models", "subPath": "l"}},
            engine={"runtime": "sim", "image": "img", "args": ["--x"], "blockSize": 32,
                    "resources": {"gpus": 2, "tensorParallelSize": 2, "memory": "8Gi", "cpu": "4",
                                  "nodeSelector": {"gpu": "a10"}, "tolerations": [{"key": "gpu"}],
                                  "affinity": AFFINITY, "topologySpreadConstraints": [SPREAD]}},
            replicas=3,
            instances={"min": 2, "max": 5},
            dispatch={"policy": "round-robin", "busyFreeness": 1.5, "topK": 2},
            migration={"enabled": False, "intervalMs": 50, "freenessThreshold": 2.0, "select": "longest",
                       "transport": "nccl", "maxConcurrentPerInstance": 3},
            autoscaling={"enabled": True, "scaleUpBelow": 5, "scaleDownAbove": 50, "intervalSeconds": 2,
                         "startupGraceSeconds": 20, "scaleDownStabilizationSeconds": 7},
            priorities={"targetLoadTokens": 800, "header": "x-p"},
            router={"replicas": 2, "port": 9000, "serviceType": "NodePort", "apiKeySecret": "keys",
                    "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "cpu"}], "affinity": AFFINITY,
                    "topologySpreadConstraints": [SPREAD]},
        )
    ).spec
    assert (spec.model.path, spec.model.source) == ("llama-2-7b", ModelSource("models", "l"))
    assert (spec.engine.image, spec.engine.args, spec.engine.block_size) == ("img", ("--x",), 32)
    res = spec.engine.resources
    assert (res.gpus, res.tensor_parallel_size, res.memory, res.cpu) == (2, 2, "8Gi", "4")
    assert res.placement == PodPlacement({"gpu": "a10"}, ({"key": "gpu"},), AFFINITY, (SPREAD,))
    assert spec.replicas == 3 and spec.instances == InstancesSpec(2, 5)
    assert (spec.dispatch.policy, spec.dispatch.busy_freeness, spec.dispatch.top_k) == ("round-robin", 1.5, 2)
    m = spec.migration
    assert (m.enabled, m.interval_ms, m.freeness_threshold, m.select, m.transport,
            m.max_concurrent_per_instance) == (False, 50, 2.0, "longest", "nccl", 3)
    a = spec.autoscaling
    assert (a.enabled, a.scale_up_below, a.scale_down_above, a.interval_s, a.startup_grace_s,
            a.scale_down_stabilization_s) == (True, 5, 50, 2, 20, 7)
    assert (spec.priorities.target_load_tokens, spec.priorities.header) == (800, "x-p")
    r = spec.router
    assert (r.replicas, r.port, r.service_type, r.api_key_secret) == (2, 9000, "NodePort", "keys")
    assert r.placement == PodPlacement({"pool": "cpu"}, ({"key": "cpu"},), AFFINITY, (SPREAD,))


def test_placement_is_empty_unless_given() -> None:
    spec = parse_service(manifest()).spec
    assert spec.engine.resources.placement == spec.router.placement == PodPlacement({}, (), {}, ())


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
        ({"model": {}}, "spec.model.name: 'name' is a required property"),
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
    assert load_service_file(str(path)).spec.engine.runtime == "sim"
    (tmp_path / "bad.yaml").write_text("a: [")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_service_file(str(tmp_path / "bad.yaml"))
    with pytest.raises(SpecError, match="cannot read"):
        load_service_file(str(tmp_path / "missing.yaml"))
    (tmp_path / "none.yaml").write_text("kind: Other\n")
    with pytest.raises(SpecError, match="no document of kind LLMService"):
        load_service_file(str(tmp_path / "none.yaml"))
