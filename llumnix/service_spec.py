"""The `LLMService` specification: one definition for the CRD, the operator and local mode.

`SPEC_SCHEMA` is the OpenAPI v3 schema of `.spec` (the CRD embeds it verbatim, see
`llumnix crd`); `CROSS_FIELD_RULES` are the checks a schema cannot express per field, each as a
Kubernetes CEL rule (enforced by the API server) and the same rule in Python (enforced by
`parse_service`, used by local mode and by the operator for status conditions).
`parse_service` validates a manifest, fills every default and returns typed settings (`ServiceSpec`,
built once here; nothing else reads the spec as a dict).
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema
import yaml

from llumnix.load import LoadModelConfig
from llumnix.policies.autoscaling import AutoscalingConfig
from llumnix.policies.dispatch import DEFAULT_PREFIX_WEIGHT
from llumnix.policies.migration import MigrationConfig

API_GROUP = "llumnix.io"
API_VERSION = "v1alpha1"
KIND = "LLMService"
PLURAL = "llmservices"
SHORT_NAMES = ["llms"]

DISPATCH_POLICIES = ["llumnix", "infaas++", "round-robin", "least-requests"]
ENGINE_RUNTIMES = ["vllm", "vllm-cpu", "sim"]


def _int(minimum: int, default: int | None = None, maximum: int | None = None, desc: str = "") -> dict:
    schema: dict[str, Any] = {"type": "integer", "minimum": minimum, "description": desc}
    if maximum is not None:
        schema["maximum"] = maximum
    if default is not None:
        schema["default"] = default
    return schema


def _num(default: float, minimum: float | None = None, desc: str = "") -> dict:
    schema: dict[str, Any] = {"type": "number", "default": default, "description": desc}
    if minimum is not None:
        schema["minimum"] = minimum
    return schema


def _obj(properties: dict, required: list[str] | None = None, desc: str = "") -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "description": desc, "default": {}}
    if required:
        schema["required"] = required
        del schema["default"]
    return schema


# Kubernetes' own pattern for a resource quantity (apimachinery's resource.Quantity): without it a
# CR with `memory: 32 GB` is accepted and every pod the operator builds from it is refused.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
                    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantity(desc: str, default: str | None = None) -> dict:
    schema: dict[str, Any] = {"type": "string", "pattern": QUANTITY_PATTERN, "description": desc}
    if default is not None:
        schema["default"] = default
    return schema


def _container_resources(cpu: str, memory: str, desc: str) -> dict:
    """CPU request and memory request = limit of a container the operator adds (router, llumlet)."""
    return _obj(
        {
            "cpu": _quantity("CPU request, e.g. 500m", cpu),
            "memory": _quantity("memory request and limit", memory),
        },
        desc=desc,
    )


def _placement(pods: str) -> dict[str, dict]:
    """Where `pods` are scheduled: Kubernetes' own pod spec fields, copied into each pod's spec as they
    are (the API server checks their contents when it gets the pod); unset, the pods have none."""
    def kubernetes_object() -> dict[str, Any]:  # a new dict each time: no YAML anchors in the CRD
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

    return {
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                         "description": f"node labels {pods} require (pod spec nodeSelector)"},
        "tolerations": {"type": "array", "items": kubernetes_object(),
                        "description": f"taints {pods} tolerate (pod spec tolerations)"},
        "affinity": {**kubernetes_object(),
                     "description": f"node affinity, pod affinity and anti-affinity of {pods} (pod spec "
                     "affinity, a Kubernetes Affinity)"},
        "topologySpreadConstraints": {
            "type": "array", "items": kubernetes_object(),
            "description": f"how {pods} spread over zones or nodes (pod spec topologySpreadConstraints); "
            "none by default",
        },
    }


SPEC_SCHEMA: dict[str, Any] = _obj(
    {
        "model": _obj(
            {
                "name": {
                    "type": "string",
                    "minLength": 1,
                    "description": "served model name (OpenAI `model`)",
                },
                "path": {
                    "type": "string",
                    "description": "model directory or hub id passed to vLLM; in local mode with "
                    "runtime vllm-cpu and no path, a tiny random model is built",
                },
                "source": _obj(
                    {
                        "pvc": {"type": "string", "description": "PersistentVolumeClaim holding the model"},
                        "subPath": {"type": "string", "description": "directory inside the claim"},
                    },
                    desc="where the weights come from on a cluster",
                ),
            },
            required=["name"],
            desc="the model every instance serves",
        ),
        "engine": _obj(
            {
                "runtime": {"type": "string", "enum": ENGINE_RUNTIMES, "default": "vllm"},
                "image": {"type": "string", "description": "engine container image (cluster mode)"},
                "args": {
                    "type": "array",
                    "items": {"type": "string"},
                    "default": [],
                    "description": "extra `vllm serve` arguments, e.g. --max-model-len=4096 or "
                                   "--dtype=bfloat16 (on CUDA both default to the model's)",
                },
                "blockSize": _int(1, desc="KV-cache block size in tokens; default: the engine's (vLLM on "
                                  "CUDA picks one for its attention backend, CPU vLLM takes 32, the sim "
                                  "engine its profile's); a multiple of 32 on CPU"),
                "gpuMemoryUtilization": {
                    "type": "number", "minimum": 0.05, "maximum": 1, "default": 0.9,
                    "description": "runtime vllm: the share of the GPU's memory the engine takes; vLLM "
                                   "sizes its KV cache with what the weights and activations leave "
                                   "(instances sharing one GPU need less than 1/n each)"},
                "resources": _obj(
                    {
                        "gpus": _int(0, 1, desc="GPUs per instance"),
                        "tensorParallelSize": _int(1, 1),
                        "memory": _quantity("memory request/limit, e.g. 32Gi"),
                        "cpu": _quantity("CPU request, e.g. '4'; on vllm-cpu also the engine's "
                                         "forward threads (its whole CPUs; without it, 1)"),
                        **_placement("engine pods"),
                    }
                ),
            }
        ),
        "replicas": _int(
            0,
            desc="desired instances (default: instances.min); the /scale subresource reads and "
            "writes it, so `kubectl scale`, HPA and KEDA act here; with built-in autoscaling on, "
            "the operator writes it",
        ),
        "instances": _obj(
            {
                "min": _int(0, 1, desc="never fewer instances"),
                "max": _int(1, 16, desc="never more instances"),
            }
        ),
        "dispatch": _obj(
            {
                "policy": {"type": "string", "enum": DISPATCH_POLICIES, "default": "llumnix"},
                "busyFreeness": _num(0.0, desc="below this freeness an instance counts as busy"),
                "topK": _int(1, 1, desc="random choice among the k best instances"),
                "prefixWeight": _num(
                    DEFAULT_PREFIX_WEIGHT, 0.0,
                    desc="llumnix policy: how much an instance holding the prompt's prefix in its cache is"
                    " preferred (its headroom counts 1 + weight x the cached share); 0: caches ignored",
                ),
            }
        ),
        "migration": _obj(
            {
                "enabled": {"type": "boolean", "default": True},
                "intervalMs": _int(10, 100, desc="how often migrations are paired"),
                "freenessThreshold": _num(3.0, desc="instances below it migrate requests out"),
                "select": {
                    "type": "string",
                    "enum": ["last-come", "shortest", "longest"],
                    "default": "last-come",
                },
                "transport": {"type": "string", "enum": ["auto", "tcp", "gloo", "nccl"], "default": "auto",
                              "description": "KV channel of migrations, negotiated per migration: auto "
                                             "takes NCCL when both engines are on CUDA, else TCP; tcp, "
                                             "gloo or nccl refuse migrations over another"},
                "maxConcurrentPerInstance": _int(1, 1),
            }
        ),
        "autoscaling": _obj(
            {
                "enabled": {"type": "boolean", "default": False},
                "scaleUpBelow": _num(
                    10.0,
                    desc="aggregate freeness below which instances are added, now or with rising demand "
                    "projected startupGraceSeconds ahead (as many as it takes to reach it again)",
                ),
                "scaleDownAbove": _num(
                    60.0,
                    desc="aggregate freeness (one instance removed) above which "
                    "the freest instance is drained and removed",
                ),
                "intervalSeconds": _num(10.0, minimum=0.1),
                "startupGraceSeconds": _num(
                    60.0,
                    minimum=0.0,
                    desc="a new instance gets this long to become ready before it is replaced; also how far "
                    "ahead the autoscaler projects rising demand",
                ),
                "scaleDownStabilizationSeconds": _num(
                    30.0, minimum=0.0, desc="scale-down waits until it has been wanted this long"
                ),
                "parkSeconds": _num(
                    60.0,
                    minimum=0.0,
                    desc="a drained instance, once empty, is kept this long before it is stopped; "
                    "a scale-up meanwhile puts it back instead of starting one",
                ),
            }
        ),
        "priorities": _obj(
            {
                "targetLoadTokens": _int(
                    1,
                    1600,
                    desc="load an instance holding high-priority requests is kept near; the "
                    "capacity above it is held as headroom",
                ),
                "header": {
                    "type": "string",
                    "default": "x-llumnix-priority",
                    "description": "request header whose value `high` marks high priority",
                },
            }
        ),
        "router": _obj(
            {
                "replicas": _int(1, 1),
                "port": _int(1, 8000, maximum=65535),
                "serviceType": {
                    "type": "string",
                    "enum": ["ClusterIP", "NodePort", "LoadBalancer"],
                    "default": "ClusterIP",
                },
                "apiKeySecret": {"type": "string", "description": "Secret whose `keys` entry lists API keys"},
                "resources": _container_resources("500m", "512Mi", "the router container's (cluster mode)"),
                **_placement("router pods"),
            }
        ),
        "llumlet": _obj(
            {
                "resources": _container_resources(
                    "500m", "512Mi", "the llumlet sidecar's in each engine pod (cluster mode); every "
                    "token crosses it, so it needs a share of a core of its own"
                ),
            }
        ),
    },
    required=["model"],
    desc="desired state of an LLMService",
)


@dataclass(frozen=True)
class CrossFieldRule:
    path: str
    """The field of .spec the rule is attached to ("" for .spec itself)."""
    cel: str
    check: Callable[[dict], bool]
    message: str


CROSS_FIELD_RULES: list[CrossFieldRule] = [
    CrossFieldRule(
        "instances",
        "self.min <= self.max",
        lambda o: o["min"] <= o["max"],
        "instances.min must be <= instances.max",
    ),
    # With built-in autoscaling on, replicas is the operator's output (the count it publishes for
    # /scale), so narrowing the bounds below or above it must not be refused: the operator clamps.
    CrossFieldRule(
        "",
        "!has(self.replicas) || self.autoscaling.enabled"
        " || (self.replicas >= self.instances.min && self.replicas <= self.instances.max)",
        lambda o: ("replicas" not in o or o["autoscaling"]["enabled"]
                   or o["instances"]["min"] <= o["replicas"] <= o["instances"]["max"]),
        "replicas must lie within [instances.min, instances.max] (with autoscaling off)",
    ),
    CrossFieldRule(
        "autoscaling",
        "self.scaleUpBelow < self.scaleDownAbove",
        lambda o: o["scaleUpBelow"] < o["scaleDownAbove"],
        "autoscaling.scaleUpBelow must be lower than autoscaling.scaleDownAbove",
    ),
]


class SpecError(ValueError):
    """An invalid LLMService; the message names the field."""


MAX_NAME_LENGTH = 54
"""The longest LLMService name whose derived names are valid: `<name>-llumlets` names a Service, a
DNS-1035 label of at most 63 characters."""
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_CEL = f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')"
NAME_MESSAGE = (f"metadata.name must be at most {MAX_NAME_LENGTH} lower-case letters, digits and '-', "
                "starting with a letter and ending with a letter or digit: it names the service's Services "
                "and pods")


def check_name(name: Any) -> str:
    """`name` if an LLMService may have it (the CRD's root rule NAME_CEL, for local mode)."""
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name is required")
    if len(name) > MAX_NAME_LENGTH or not re.match(NAME_PATTERN, name):
        raise SpecError(f"{NAME_MESSAGE}; got {name!r}")
    return name


def _unknown_fields(schema: dict, value: Any, path: str) -> list[str]:
    """Fields of `value` that `schema` does not define, with a suggestion. The API server refuses
    them too (kubectl's strict field validation) instead of silently dropping a misspelt field."""
    properties = schema.get("properties")
    if not isinstance(value, dict) or not properties:
        return []
    found = []
    for key, sub_value in value.items():
        if key not in properties:
            close = difflib.get_close_matches(str(key), properties, n=1)
            found.append(f"{path}.{key}: unknown field" + (f"; did you mean {close[0]!r}?" if close else ""))
        else:
            found += _unknown_fields(properties[key], sub_value, f"{path}.{key}")
    return found


def apply_defaults(schema: dict, value: Any) -> Any:
    """Fill schema defaults into `value` (a copy), recursively through objects."""
    if value is None and "default" in schema:
        value = copy.deepcopy(schema["default"])
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            filled = apply_defaults(sub, value.get(key))
            if filled is not None:
                value[key] = filled
    return value


def _validated(spec: Any) -> dict:
    """`spec` with defaults filled, checked against SPEC_SCHEMA and CROSS_FIELD_RULES."""
    if not isinstance(spec, dict):
        raise SpecError("spec must be a mapping")
    unknown = _unknown_fields(SPEC_SCHEMA, spec, "spec")
    if unknown:
        raise SpecError(unknown[0])
    filled = apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    errors = sorted(jsonschema.Draft7Validator(SPEC_SCHEMA).iter_errors(filled), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        where = ["spec", *(str(p) for p in err.path)]
        if err.validator == "required":  # name the missing field, not its parent
            where += [field for field in err.validator_value if field not in err.instance][:1]
        raise SpecError(f"{'.'.join(where)}: {err.message}")
    for rule in CROSS_FIELD_RULES:
        if not rule.check(filled[rule.path] if rule.path else filled):
            raise SpecError(f"spec.{rule.path}: {rule.message}" if rule.path else f"spec: {rule.message}")
    return filled


# The typed `.spec`: one frozen dataclass per object of SPEC_SCHEMA, field for field (camelCase keys
# become snake_case; absent optional strings are None; the four pod placement fields, wherever they
# sit, are one PodPlacement). Built only from a validated dict.


@dataclass(frozen=True)
class ModelSource:
    pvc: str | None
    sub_path: str | None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str | None
    source: ModelSource


@dataclass(frozen=True)
class PodPlacement:
    """The scheduling fields of a pod (`_placement`), as written; empty: not set."""

    node_selector: Mapping[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity: Mapping[str, Any]
    topology_spread_constraints: tuple[dict[str, Any], ...]

    @classmethod
    def from_validated(cls, parent: dict) -> PodPlacement:
        """The placement fields of `parent` (engine.resources or router)."""
        return cls(
            node_selector=dict(parent.get("nodeSelector") or {}),
            tolerations=tuple(parent.get("tolerations") or ()),
            affinity=dict(parent.get("affinity") or {}),
            topology_spread_constraints=tuple(parent.get("topologySpreadConstraints") or ()),
        )


@dataclass(frozen=True)
class EngineResources:
    gpus: int
    tensor_parallel_size: int
    memory: str | None
    cpu: str | None
    placement: PodPlacement
    """nodeSelector, tolerations, affinity, topologySpreadConstraints."""


@dataclass(frozen=True)
class ContainerResources:
    cpu: str
    memory: str


@dataclass(frozen=True)
class EngineSpec:
    runtime: str
    image: str | None
    args: tuple[str, ...]
    block_size: int | None
    """None: the engine's own."""
    gpu_memory_utilization: float
    resources: EngineResources


@dataclass(frozen=True)
class InstancesSpec:
    min: int
    max: int


@dataclass(frozen=True)
class DispatchSpec:
    policy: str
    busy_freeness: float
    top_k: int
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT


@dataclass(frozen=True)
class MigrationSpec:
    enabled: bool
    interval_ms: int
    freeness_threshold: float
    select: str
    transport: str
    max_concurrent_per_instance: int


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool
    scale_up_below: float
    scale_down_above: float
    interval_s: float
    startup_grace_s: float
    scale_down_stabilization_s: float
    park_s: float


@dataclass(frozen=True)
class PrioritiesSpec:
    target_load_tokens: int
    header: str


@dataclass(frozen=True)
class RouterSpec:
    replicas: int
    port: int
    service_type: str
    api_key_secret: str | None
    resources: ContainerResources
    placement: PodPlacement
    """nodeSelector, tolerations, affinity, topologySpreadConstraints."""


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    engine: EngineSpec
    replicas: int | None
    """None: not set (the desired count is instances.min)."""
    instances: InstancesSpec
    dispatch: DispatchSpec
    migration: MigrationSpec
    autoscaling: AutoscalingSpec
    priorities: PrioritiesSpec
    router: RouterSpec
    llumlet_resources: ContainerResources

    @classmethod
    def from_validated(cls, spec: dict) -> ServiceSpec:
        """The typed form of a dict `_validated` returned (every default filled)."""
        model, engine, migration = spec["model"], spec["engine"], spec["migration"]
        resources, autoscaling, router = engine["resources"], spec["autoscaling"], spec["router"]
        return cls(
            model=ModelSpec(model["name"], model.get("path"),
                            ModelSource(model["source"].get("pvc"), model["source"].get("subPath"))),
            engine=EngineSpec(
                runtime=engine["runtime"], image=engine.get("image"), args=tuple(engine["args"]),
                block_size=engine.get("blockSize"), gpu_memory_utilization=engine["gpuMemoryUtilization"],
                resources=EngineResources(
                    gpus=resources["gpus"], tensor_parallel_size=resources["tensorParallelSize"],
                    memory=resources.get("memory"), cpu=resources.get("cpu"),
                    placement=PodPlacement.from_validated(resources))),
            replicas=spec.get("replicas"),
            instances=InstancesSpec(spec["instances"]["min"], spec["instances"]["max"]),
            dispatch=DispatchSpec(spec["dispatch"]["policy"], spec["dispatch"]["busyFreeness"],
                                  spec["dispatch"]["topK"], spec["dispatch"]["prefixWeight"]),
            migration=MigrationSpec(
                enabled=migration["enabled"], interval_ms=migration["intervalMs"],
                freeness_threshold=migration["freenessThreshold"], select=migration["select"],
                transport=migration["transport"],
                max_concurrent_per_instance=migration["maxConcurrentPerInstance"]),
            autoscaling=AutoscalingSpec(
                enabled=autoscaling["enabled"], scale_up_below=autoscaling["scaleUpBelow"],
                scale_down_above=autoscaling["scaleDownAbove"], interval_s=autoscaling["intervalSeconds"],
                startup_grace_s=autoscaling["startupGraceSeconds"],
                scale_down_stabilization_s=autoscaling["scaleDownStabilizationSeconds"],
                park_s=autoscaling["parkSeconds"]),
            priorities=PrioritiesSpec(spec["priorities"]["targetLoadTokens"], spec["priorities"]["header"]),
            router=RouterSpec(router["replicas"], router["port"], router["serviceType"],
                              router.get("apiKeySecret"), ContainerResources(**router["resources"]),
                              PodPlacement.from_validated(router)),
            llumlet_resources=ContainerResources(**spec["llumlet"]["resources"]),
        )


def validate_spec(spec: Any) -> ServiceSpec:
    """Validate `.spec` against SPEC_SCHEMA and CROSS_FIELD_RULES; return it typed, defaults filled."""
    return ServiceSpec.from_validated(_validated(spec))


@dataclass(frozen=True)
class ServiceSettings:
    """A validated LLMService: its name and its typed spec with every default filled."""

    name: str
    namespace: str
    spec: ServiceSpec

    @property
    def desired_instances(self) -> int:
        return self.spec.instances.min if self.spec.replicas is None else self.spec.replicas

    @property
    def load_model(self) -> LoadModelConfig:
        return LoadModelConfig(high_priority_target_tokens=self.spec.priorities.target_load_tokens)

    @property
    def migration(self) -> MigrationConfig:
        m = self.spec.migration
        return MigrationConfig.with_threshold(m.freeness_threshold, m.select, m.max_concurrent_per_instance)

    @property
    def llumlet_args(self) -> list[str]:
        """The llumlet flags this spec sets, the same on a cluster and in local mode."""
        m = self.spec.migration
        return ["--high-priority-target-tokens", str(self.spec.priorities.target_load_tokens),
                "--migration-select", m.select,
                "--max-concurrent-migrations", str(m.max_concurrent_per_instance),
                "--migration-transport", m.transport]

    @property
    def autoscaling(self) -> AutoscalingConfig:
        a, instances = self.spec.autoscaling, self.spec.instances
        return AutoscalingConfig(
            scale_up_below=a.scale_up_below,
            scale_down_above=a.scale_down_above,
            min_instances=instances.min,
            max_instances=instances.max,
            interval_s=a.interval_s,
            startup_delay_s=a.startup_grace_s,
            park_s=a.park_s,
        )


def parse_service(manifest: Any) -> ServiceSettings:
    """Validate a whole LLMService manifest (apiVersion, kind, metadata.name, spec)."""
    if not isinstance(manifest, dict):
        raise SpecError("an LLMService manifest must be a mapping")
    expected = f"{API_GROUP}/{API_VERSION}"
    if manifest.get("apiVersion") != expected:
        raise SpecError(f"apiVersion must be {expected!r}, got {manifest.get('apiVersion')!r}")
    if manifest.get("kind") != KIND:
        raise SpecError(f"kind must be {KIND!r}, got {manifest.get('kind')!r}")
    metadata = manifest.get("metadata") or {}
    name = check_name(metadata.get("name"))
    return ServiceSettings(name, metadata.get("namespace", "default"), validate_spec(manifest.get("spec")))


def load_service_file(path: str) -> ServiceSettings:
    """Read an LLMService manifest from a YAML file (the first document of kind LLMService)."""
    try:
        with open(path, encoding="utf-8") as f:
            documents = [d for d in yaml.safe_load_all(f) if d is not None]
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    for doc in documents:
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            return parse_service(doc)
    raise SpecError(f"{path} holds no document of kind {KIND}")
