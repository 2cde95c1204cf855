"""The operator's pure builders: an LLMService spec -> the manifests it owns (hand-checked values)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from llumnix.service_spec import ServiceSettings, validate_spec
from llumnix_operator.access import role, role_binding, service_account
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.disruption_budget import disruption_budget
from llumnix_operator.engine_pod import SNAPSHOT_ADDR, engine_pod, engine_pod_template
from llumnix_operator.handlers import owned_objects
from llumnix_operator.llumlet_service import llumlets_service
from llumnix_operator.naming import ENGINE, ROUTER, TEMPLATE_HASH_ANNOTATION, owner_reference
from llumnix_operator.placement import PLACEMENT_FIELDS
from llumnix_operator.pod_security import WRITABLE_ENV
from llumnix_operator.router import router_deployment, router_fields_to_clear, router_service, router_urls

CONFIG = BuildConfig(image="reg/llumnix:1", vllm_image="reg/llumnix-vllm:1", drain_timeout_s=100)


def settings(**spec: object) -> ServiceSettings:
    return ServiceSettings("llama", "prod", validate_spec({"model": {"name": "llama-7b"}, **spec}))


def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def test_vllm_engine_pod_runs_vllm_with_the_connector_and_the_llumlet_sidecar() -> None:
    s = settings(
        model={"name": "llama-7b", "source": {"pvc": "models", "subPath": "llama-2-7b"}},
        engine={
            "args": ["--max-model-len=4096"],
            "resources": {
                "gpus": 2,
                "tensorParallelSize": 2,
                "memory": "64Gi",
                "nodeSelector": {"gpu": "a10"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            },
        },
    )
    pod = engine_pod(s, CONFIG)
    engine, llumlet = containers(pod)["engine"], containers(pod)["llumlet"]
    assert engine["image"] == "reg/llumnix-vllm:1" and llumlet["image"] == "reg/llumnix:1"
    argv = engine["command"] + engine["args"]
    assert argv[:3] == ["python", "-m", "llumnix.engine.vllm_server"]
    assert argv[argv.index("--model") + 1] == "/model"
    assert argv[argv.index("--served-model-name") + 1] == "llama-7b"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[-1] == "--max-model-len=4096"  # user args last: they win over the defaults
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "llumnix.engine.kv_connector"
    assert kv["kv_connector_extra_config"]["snapshot_addr"] == SNAPSHOT_ADDR
    assert engine["resources"] == {
        "requests": {"nvidia.com/gpu": "2", "memory": "64Gi"},
        "limits": {"nvidia.com/gpu": "2", "memory": "64Gi"},
    }
    assert {"name": "model", "mountPath": "/model", "readOnly": True, "subPath": "llama-2-7b"} in engine[
        "volumeMounts"
    ]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "spec"
    ]["volumes"]
    assert pod["spec"]["nodeSelector"] == {"gpu": "a10"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    # The socket directory is shared; /dev/shm is memory-backed for vLLM's workers.
    assert {"name": "llumnix-run", "mountPath": "/run/llumnix"} in llumlet["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]


def test_engine_pod_probes_drain_hook_and_grace() -> None:
    pod = engine_pod(settings(), CONFIG)
    engine, llumlet = containers(pod)["engine"], containers(pod)["llumlet"]
    hook = ["llumnix", "drain-instance", "--address", "127.0.0.1:50051", "--timeout", "100"]
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == hook
    assert llumlet["lifecycle"]["preStop"]["exec"]["command"] == hook
    assert pod["spec"]["terminationGracePeriodSeconds"] == 130 > CONFIG.drain_timeout_s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert llumlet[probe]["httpGet"] == {"path": "/health", "port": "llumlet-http"}
    # Start-up may take as long as a model load: 5 s x 180.
    assert llumlet["startupProbe"]["periodSeconds"] * llumlet["startupProbe"]["failureThreshold"] == 900
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    token = {"name": "LLUMNIX_SERVICE_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": "llama-llumlet-token", "key": "token"}}}
    assert llumlet["env"] == [
        pod_ip,
        {"name": "LLUMNIX_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *WRITABLE_ENV,
        token,
    ]
    assert "--allow-unauthenticated" not in llumlet["args"]
    assert token in engine["env"]  # its drain hook presents it too
    args = llumlet["args"]
    assert args[args.index("--engine-url") + 1] == "http://127.0.0.1:8000"
    assert args[args.index("--migration-select") + 1] == "last-come"
    assert args[args.index("--max-concurrent-migrations") + 1] == "1"
    assert args[args.index("--migration-transport") + 1] == "auto"
    assert "--high-priority-target-tokens" in args
    # The connector's KV receiver listens on the pod IP (POD_IP is declared first, so it expands).
    assert engine["env"][0] == pod_ip
    assert {"name": "LLUMNIX_KV_HOST", "value": "$(POD_IP)"} in engine["env"]
    assert engine["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}


def test_sim_engine_pod_uses_the_project_image_and_no_gpu() -> None:
    pod = engine_pod(settings(engine={"runtime": "sim", "blockSize": 32, "resources": {"gpus": 0}}), CONFIG)
    engine = containers(pod)["engine"]
    assert engine["image"] == "reg/llumnix:1"
    assert engine["command"] + engine["args"] == [
        "python",
        "-m",
        "llumnix.sim_engine",
        "--host",
        "127.0.0.1",
        "--kv-host",
        "$(POD_IP)",
        "--port",
        "8000",
        "--model",
        "llama-7b",
        "--snapshot-addr",
        SNAPSHOT_ADDR,
        "--block-size",
        "32",
    ]
    assert engine["resources"] == {}
    llumlet_args = containers(pod)["llumlet"]["args"]
    # Its HTTP API is on localhost behind the llumlet; only its KV receiver is on the pod IP.
    assert llumlet_args[llumlet_args.index("--engine-url") + 1] == "http://127.0.0.1:8000"


@pytest.mark.parametrize("runtime", ["vllm", "sim"])
def test_the_engine_listens_on_localhost_and_only_its_kv_receiver_on_the_pod_ip(runtime: str) -> None:
    pod = engine_pod(settings(engine={"runtime": runtime, "blockSize": 32}), CONFIG)
    engine, llumlet = containers(pod)["engine"], containers(pod)["llumlet"]
    argv = engine["command"] + engine["args"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    kv_host = (argv[argv.index("--kv-host") + 1] if runtime == "sim"
               else next(e["value"] for e in engine["env"] if e["name"] == "LLUMNIX_KV_HOST"))
    assert kv_host == "$(POD_IP)"
    assert not any(port["containerPort"] == 8000 for port in llumlet["ports"])
    assert llumlet["args"][llumlet["args"].index("--engine-url") + 1] == "http://127.0.0.1:8000"


@pytest.mark.parametrize("runtime", ["vllm", "sim"])
def test_the_llumlet_sidecar_honours_the_migration_transport(runtime: str) -> None:
    pod = engine_pod(settings(engine={"runtime": runtime}, migration={"transport": "nccl"}), CONFIG)
    args = containers(pod)["llumlet"]["args"]
    assert args[args.index("--migration-transport") + 1] == "nccl"


def test_engine_pod_labels_name_and_template_hash() -> None:
    s = settings()
    pod = engine_pod(s, CONFIG)
    meta = pod["metadata"]
    assert meta["generateName"] == "llama-engine-" and meta["namespace"] == "prod"
    assert meta["labels"]["llumnix.io/service"] == "llama"
    assert meta["labels"]["app.kubernetes.io/component"] == "engine"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "llumnix-operator"
    same = meta["annotations"][TEMPLATE_HASH_ANNOTATION]
    assert same == engine_pod(s, CONFIG)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    changed = engine_pod(settings(engine={"args": ["--x"]}), CONFIG)["metadata"]["annotations"]
    assert changed[TEMPLATE_HASH_ANNOTATION] != same
    # Scaling does not change the template (no rolling replacement for a replica change).
    assert engine_pod_template(
        settings(replicas=3, instances={"min": 1, "max": 4}), CONFIG
    ) == engine_pod_template(s, CONFIG)


def test_headless_llumlet_service_selects_ready_engine_pods() -> None:
    svc = llumlets_service(settings())
    assert svc["metadata"]["name"] == "llama-llumlets"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"] == {"llumnix.io/service": "llama", "app.kubernetes.io/component": "engine"}
    assert {"name": "grpc", "port": 50051, "targetPort": "llumlet-grpc"} in svc["spec"]["ports"]


def test_router_tokenizes_prompts_from_the_model_claim_for_prefix_dispatch() -> None:
    claim = {"name": "llama-7b", "path": "llama-2-7b", "source": {"pvc": "models"}}
    pod = router_deployment(settings(model=claim), CONFIG)["spec"]["template"]["spec"]
    router = pod["containers"][0]
    assert router["args"][router["args"].index("--tokenizer") + 1] == "/model/llama-2-7b"
    claim_volume = {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert claim_volume in pod["volumes"]
    assert {"name": "model", "mountPath": "/model", "readOnly": True} in router["volumeMounts"]
    # No folder to read (a hub id), no model (sim), or prefix dispatch off: no tokenizer, no claim.
    for spec in ({}, {"model": claim, "engine": {"runtime": "sim"}},
                 {"model": claim, "dispatch": {"prefixWeight": 0}}):
        pod = router_deployment(settings(**spec), CONFIG)["spec"]["template"]["spec"]
        assert "--tokenizer" not in pod["containers"][0]["args"]
        assert all(v["name"] != "model" for v in pod["volumes"])


def test_router_finds_llumlets_by_dns_and_mounts_api_keys() -> None:
    s = settings(
        router={"replicas": 2, "port": 9000, "serviceType": "LoadBalancer", "apiKeySecret": "keys"},
        dispatch={"policy": "infaas++"},
    )
    deployment = router_deployment(s, CONFIG)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert deployment["spec"]["replicas"] == 2
    assert container["command"] == ["llumnix"] and args[0] == "router"
    assert args[args.index("--instances-dns") + 1] == "llama-llumlets.prod.svc:50051"
    assert args[args.index("--dispatch-policy") + 1] == "infaas++"
    assert args[args.index("--api-keys-file") + 1] == "/etc/llumnix/api-keys/keys"
    assert {"name": "api-keys", "secret": {"secretName": "keys"}} in pod["spec"]["volumes"]
    token = {"name": "LLUMNIX_SERVICE_TOKEN",  # what the llumlets require, from the service's Secret
             "valueFrom": {"secretKeyRef": {"name": "llama-llumlet-token", "key": "token"}}}
    assert token in container["env"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    service = router_service(s)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http"}]


def test_workload_identity_has_no_token_and_one_read_verb() -> None:
    s = settings()
    assert service_account(s)["automountServiceAccountToken"] is False
    assert role(s)["rules"] == [
        {
            "apiGroups": ["llumnix.io"],
            "resources": ["llmservices"],
            "resourceNames": ["llama"],
            "verbs": ["get"],
        }
    ]
    binding = role_binding(s)
    assert binding["roleRef"]["name"] == role(s)["metadata"]["name"] == "llama-llumnix"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-llumnix", "namespace": "prod"}]


def test_disruption_budget_allows_one_engine_down() -> None:
    pdb = disruption_budget(settings(), ENGINE)
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"llumnix.io/service": "llama", "app.kubernetes.io/component": "engine"}},
    }


def test_disruption_budget_allows_one_router_down() -> None:
    pdb = disruption_budget(settings(), ROUTER)
    assert pdb["metadata"]["name"] == "llama-router"
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"


def test_owned_objects_are_namespaced_and_labelled() -> None:
    objects = owned_objects(settings(), CONFIG)
    assert sorted(o["kind"] for o in objects) == [
        "Deployment",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
    ]
    for o in objects:
        assert o["metadata"]["namespace"] == "prod"
        assert o["metadata"]["labels"]["llumnix.io/service"] == "llama"


def test_the_token_secret_holds_a_fresh_token_in_data() -> None:
    first, second = (next(o for o in owned_objects(settings(), CONFIG) if o["kind"] == "Secret")
                     for _ in range(2))
    assert first["metadata"]["name"] == "llama-llumlet-token" and first["type"] == "Opaque"
    token = base64.b64decode(first["data"]["token"]).decode()
    assert len(token) >= 32 and first["data"] != second["data"]  # made once; the ensurer never patches it


def test_owner_reference_is_a_controller_reference() -> None:
    owner = {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "llama", "uid": "u1"},
    }
    assert owner_reference(owner) == {
        "apiVersion": "llumnix.io/v1alpha1",
        "kind": "LLMService",
        "name": "llama",
        "uid": "u1",
        "controller": True,
        "blockOwnerDeletion": True,
    }


@pytest.mark.parametrize("runtime", ["vllm", "vllm-cpu"])
def test_vllm_device_follows_the_runtime(runtime: str) -> None:
    engine = containers(engine_pod(settings(engine={"runtime": runtime, "blockSize": 32}), CONFIG))["engine"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert ("VLLM_TARGET_DEVICE" in env) == (runtime == "vllm-cpu")
    assert ("--enforce-eager" in engine["args"]) == (runtime == "vllm-cpu")


def restricted(pod_spec: dict) -> None:
    """What Pod Security's "restricted" profile requires of a pod and its containers."""
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod_spec["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/var/lib/llumnix"} <= mounts, container["name"]  # caches on emptyDirs
        assert {"name": "HOME", "value": "/var/lib/llumnix"} in container["env"]


def test_every_pod_the_operator_creates_is_restricted() -> None:
    restricted(engine_pod(settings(), CONFIG)["spec"])
    restricted(router_deployment(settings(), CONFIG)["spec"]["template"]["spec"])


def test_image_pull_secrets_reach_every_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLUMNIX_IMAGE_PULL_SECRETS", "regcred,mirror")
    config = BuildConfig.from_env()
    expected = [{"name": "regcred"}, {"name": "mirror"}]
    assert engine_pod(settings(), config)["spec"]["imagePullSecrets"] == expected
    assert router_deployment(settings(), config)["spec"]["template"]["spec"]["imagePullSecrets"] == expected
    assert "imagePullSecrets" not in engine_pod(settings(), CONFIG)["spec"]


def test_router_and_llumlet_get_resources_from_the_spec_defaults() -> None:
    default = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "512Mi"}}
    pod = engine_pod(settings(), CONFIG)
    llumlet = next(c for c in pod["spec"]["containers"] if c["name"] == "llumlet")
    assert llumlet["resources"] == default
    router = router_deployment(settings(), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    assert router["resources"] == default
    s = settings(router={"resources": {"cpu": "2", "memory": "1Gi"}}, llumlet={"resources": {"cpu": "1"}})
    assert router_deployment(s, CONFIG)["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    llumlet = next(c for c in engine_pod(s, CONFIG)["spec"]["containers"] if c["name"] == "llumlet")
    assert llumlet["resources"]["requests"] == {"cpu": "1", "memory": "512Mi"}


PLACEMENT = {
    "nodeSelector": {"pool": "serving"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}
        ]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"llumnix.io/service": "llama"}}},
        }]},
    },
    "topologySpreadConstraints": [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"llumnix.io/service": "llama"}},
    }],
}


def router_pod_spec(s: ServiceSettings) -> dict:
    return router_deployment(s, CONFIG)["spec"]["template"]["spec"]


def test_placement_reaches_engine_and_router_pods_as_written() -> None:
    s = settings(engine={"resources": PLACEMENT}, router=PLACEMENT)
    for pod_spec in (engine_pod(s, CONFIG)["spec"], router_pod_spec(s)):
        assert {field: pod_spec[field] for field in PLACEMENT_FIELDS} == PLACEMENT
    # Copies: a built manifest shares nothing with the settings (or with the next one built).
    engine_pod(s, CONFIG)["spec"]["affinity"]["nodeAffinity"].clear()
    router_pod_spec(s)["tolerations"][0]["key"] = "changed"
    assert {field: engine_pod(s, CONFIG)["spec"][field] for field in PLACEMENT_FIELDS} == PLACEMENT
    assert {field: router_pod_spec(s)[field] for field in PLACEMENT_FIELDS} == PLACEMENT


@pytest.mark.parametrize("field", PLACEMENT_FIELDS)
def test_each_placement_field_goes_only_where_it_is_set(field: str) -> None:
    engine_only = settings(engine={"resources": {field: PLACEMENT[field]}})
    router_only = settings(router={field: PLACEMENT[field]})
    assert engine_pod(engine_only, CONFIG)["spec"][field] == PLACEMENT[field]
    assert router_pod_spec(router_only)[field] == PLACEMENT[field]
    for pod_spec in (router_pod_spec(engine_only), engine_pod(router_only, CONFIG)["spec"]):
        assert not set(PLACEMENT_FIELDS) & set(pod_spec)


def test_no_placement_field_without_a_setting() -> None:
    # No default affinity or spread: pods and the router Deployment are built as before these fields.
    s = settings()
    assert not set(PLACEMENT_FIELDS) & set(engine_pod(s, CONFIG)["spec"])
    assert not set(PLACEMENT_FIELDS) & set(router_pod_spec(s))
    empty = settings(engine={"resources": {"nodeSelector": {}, "tolerations": [], "affinity": {},
                                           "topologySpreadConstraints": []}})
    assert engine_pod_template(empty, CONFIG) == engine_pod_template(s, CONFIG)


def test_engine_placement_changes_the_template_hash_router_placement_does_not() -> None:
    def template_hash(s: ServiceSettings) -> str:
        return engine_pod(s, CONFIG)["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]

    base = template_hash(settings())
    assert template_hash(settings(router=PLACEMENT)) == base
    assert template_hash(settings(engine={"resources": {"affinity": PLACEMENT["affinity"]}})) != base


def test_router_placement_dropped_from_the_spec_is_named_for_removal() -> None:
    old = {"model": {"name": "llama-7b"}, "router": PLACEMENT}
    kept = {"nodeSelector": PLACEMENT["nodeSelector"]}
    dropped = ("tolerations", "affinity", "topologySpreadConstraints")
    assert router_fields_to_clear(settings(router=kept), old) == [
        ("spec", "template", "spec", field) for field in dropped
    ]
    assert router_fields_to_clear(settings(router=PLACEMENT), old) == []
    assert router_fields_to_clear(settings(), None) == []  # create / resume: nothing to compare with
    assert router_fields_to_clear(settings(), {"model": {"name": "llama-7b"}}) == []


def test_router_urls_are_the_running_router_pods() -> None:
    def router_pod(name: str, phase: str, ip: str | None, deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name}
        if deleting:
            meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
        return {"metadata": meta, "status": {"phase": phase, **({"podIP": ip} if ip else {})}}

    pods = [router_pod("r1", "Running", "10.0.0.7"), router_pod("r2", "Pending", None),
            router_pod("r3", "Running", "10.0.0.8", deleting=True), router_pod("r4", "Running", "fd00::5"),
            router_pod("r5", "Failed", "10.0.0.9")]
    assert router_urls(pods, 8000) == ["http://10.0.0.7:8000", "http://[fd00::5]:8000"]
