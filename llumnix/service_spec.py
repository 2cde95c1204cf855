"""The `LLMService` specification: one definition for the CRD, the operator and local mode.

`SPEC_SCHEMA` is the OpenAPI v3 schema of `.spec` (the CRD embeds it verbatim, see
`llumnix crd`); `CROSS_FIELD_RULES` are the checks a schema cannot express per field, each as a
Kubernetes CEL rule (enforced by the API server) and the same rule in Python (enforced by
`parse_service`, used by local mode and by the operator for status conditions).
`parse_service` validates a manifest, fills every default and returns typed settings.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import yaml

from llumnix.load import LoadModelConfig
from llumnix.policies.autoscaling import AutoscalingConfig
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
                    "description": "extra `vllm serve` arguments",
                },
                "blockSize": _int(1, 16, desc="KV-cache block size in tokens (a multiple of 32 on CPU)"),
                "resources": _obj(
                    {
                        "gpus": _int(0, 1, desc="GPUs per instance"),
                        "tensorParallelSize": _int(1, 1),
                        "memory": {"type": "string", "description": "memory request/limit, e.g. 32Gi"},
                        "cpu": {"type": "string", "description": "CPU request, e.g. '4'"},
                        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                        "tolerations": {
                            "type": "array",
                            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
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
                "transport": {"type": "string", "enum": ["auto", "tcp", "nccl"], "default": "auto"},
                "maxConcurrentPerInstance": _int(1, 1),
            }
        ),
        "autoscaling": _obj(
            {
                "enabled": {"type": "boolean", "default": False},
                "scaleUpBelow": _num(10.0, desc="aggregate freeness below which an instance is added"),
                "scaleDownAbove": _num(
                    60.0,
                    desc="aggregate freeness (one instance removed) above which "
                    "the freest instance is drained and removed",
                ),
                "intervalSeconds": _num(10.0, minimum=0.1),
                "startupGraceSeconds": _num(
                    60.0,
                    minimum=0.0,
                    desc="a new instance gets this long to become ready before it is replaced",
                ),
                "scaleDownStabilizationSeconds": _num(
                    30.0, minimum=0.0, desc="scale-down waits until it has been wanted this long"
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
    CrossFieldRule(
        "",
        "!has(self.replicas) || (self.replicas >= self.instances.min && self.replicas <= self.instances.max)",
        lambda o: "replicas" not in o or o["instances"]["min"] <= o["replicas"] <= o["instances"]["max"],
        "replicas must lie within [instances.min, instances.max]",
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


def validate_spec(spec: Any) -> dict:
    """Validate `.spec` against SPEC_SCHEMA and CROSS_FIELD_RULES; return it with defaults filled."""
    if not isinstance(spec, dict):
        raise SpecError("spec must be a mapping")
    filled = apply_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    errors = sorted(jsonschema.Draft7Validator(SPEC_SCHEMA).iter_errors(filled), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.path) or "spec"
        raise SpecError(f"spec.{where}: {err.message}" if err.path else f"spec: {err.message}")
    for rule in CROSS_FIELD_RULES:
        if not rule.check(filled[rule.path] if rule.path else filled):
            raise SpecError(f"spec.{rule.path}: {rule.message}" if rule.path else f"spec: {rule.message}")
    return filled


@dataclass(frozen=True)
class ServiceSettings:
    """A validated LLMService: its name and its spec with every default filled."""

    name: str
    namespace: str
    spec: dict

    @property
    def desired_instances(self) -> int:
        return int(self.spec.get("replicas", self.spec["instances"]["min"]))

    @property
    def load_model(self) -> LoadModelConfig:
        return LoadModelConfig(high_priority_target_tokens=self.spec["priorities"]["targetLoadTokens"])

    @property
    def migration(self) -> MigrationConfig:
        m = self.spec["migration"]
        return MigrationConfig(
            freeness_threshold=m["freenessThreshold"],
            select=m["select"],
            max_concurrent_per_instance=m["maxConcurrentPerInstance"],
        )

    @property
    def llumlet_args(self) -> list[str]:
        """The llumlet flags this spec sets, the same on a cluster and in local mode."""
        return ["--high-priority-target-tokens", str(self.spec["priorities"]["targetLoadTokens"]),
                "--migration-select", self.spec["migration"]["select"],
                "--max-concurrent-migrations", str(self.spec["migration"]["maxConcurrentPerInstance"])]

    @property
    def autoscaling(self) -> AutoscalingConfig:
        a, instances = self.spec["autoscaling"], self.spec["instances"]
        return AutoscalingConfig(
            scale_up_below=a["scaleUpBelow"],
            scale_down_above=a["scaleDownAbove"],
            min_instances=instances["min"],
            max_instances=instances["max"],
            interval_s=a["intervalSeconds"],
            startup_delay_s=a["startupGraceSeconds"],
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
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("metadata.name is required")
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
