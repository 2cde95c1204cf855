"""The engine pod of an LLMService: the engine container (vLLM with the llumnix KV connector, or the
sim engine) and the llumlet sidecar, sharing the connector's snapshot socket through an emptyDir.

Pods are created one at a time by the control loop (the operator decides which pod is drained and
deleted), so this builds a complete pod, not a Deployment template. The template hash annotation is a
digest of everything built here: a change to it means a rolling replacement."""

from __future__ import annotations

import copy
from pathlib import PurePosixPath
from typing import Any

from llumnix.launch.engine_process import build_command, engine_launch_config
from llumnix.service_spec import EngineResources, ModelSource, ModelSpec, ServiceSettings, ServiceSpec
from llumnix_operator.build_config import BuildConfig
from llumnix_operator.container_resources import container_resources
from llumnix_operator.naming import (
    ENGINE,
    ENGINE_PORT,
    LLUMLET_GRPC_PORT,
    LLUMLET_HTTP_PORT,
    TEMPLATE_HASH_ANNOTATION,
    engine_pod_prefix,
    labels,
    service_account_name,
    template_hash,
)
from llumnix_operator.placement import pod_placement
from llumnix_operator.pod_security import (
    CONTAINER_SECURITY_CONTEXT,
    POD_SECURITY_CONTEXT,
    WRITABLE_ENV,
    WRITABLE_MOUNTS,
    WRITABLE_VOLUMES,
)
from llumnix_operator.service_token_secret import token_env

SOCKET_DIR = "/run/llumnix"
SNAPSHOT_ADDR = f"ipc://{SOCKET_DIR}/snapshots.sock"
MODEL_MOUNT = "/model"
INSTANCE_ID_ENV = "LLUMNIX_INSTANCE_ID"
POD_IP_ENV = "POD_IP"
KV_HOST_ENV = "LLUMNIX_KV_HOST"
"""llumnix.engine.kv_connector.KV_HOST_ENV (that module imports vLLM, which the operator's image lacks)."""
POD_IP_REF = f"$({POD_IP_ENV})"
"""Expanded by the kubelet in args and env values (the downward API sets POD_IP)."""
POD_IP_VAR = {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
GPU_RESOURCE = "nvidia.com/gpu"


def model_location(model: ModelSpec) -> str:
    """What the engine loads: inside the model volume when the spec names a PVC, else the path or hub id."""
    if model.source.pvc:
        return str(PurePosixPath(MODEL_MOUNT) / model.path) if model.path else MODEL_MOUNT
    return model.path or model.name


def engine_command(spec: ServiceSpec) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the engine container."""
    engine, model_name = spec.engine, spec.model.name
    if engine.runtime == "sim":
        argv = [
            "python",
            "-m",
            "llumnix.sim_engine",
            "--host",
            "127.0.0.1",  # only the llumlet beside it talks to its HTTP API
            "--kv-host",
            POD_IP_REF,  # peer engines send migrations to its KV receiver
            "--port",
            str(ENGINE_PORT),
            "--model",
            model_name,
            "--snapshot-addr",
            SNAPSHOT_ADDR,
            *(["--block-size", str(engine.block_size)] if engine.block_size else []),
            *engine.args,
        ]
        return argv, {}
    launch = engine_launch_config(engine, model=model_location(spec.model), served_model_name=model_name,
                                  port=ENGINE_PORT, snapshot_addr=SNAPSHOT_ADDR, python="python")
    argv, env = build_command(launch)
    # The connector's KV receiver (live migration) listens on the pod IP, where peer engines reach it.
    return argv, {**env, KV_HOST_ENV: POD_IP_REF}


def _resources(res: EngineResources) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(res.gpus)
    if res.memory:
        requests["memory"] = limits["memory"] = res.memory
    if res.cpu:
        requests["cpu"] = res.cpu
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _drain_hook(config: BuildConfig) -> dict[str, Any]:
    return {
        "exec": {
            "command": [
                "llumnix",
                "drain-instance",
                "--address",
                f"127.0.0.1:{LLUMLET_GRPC_PORT}",
                "--timeout",
                str(config.drain_timeout_s),
            ]
        }
    }


def _health_probe(period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "llumlet-http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _volumes(source: ModelSource) -> tuple[list[dict], list[dict]]:
    volumes: list[dict] = [
        {"name": "llumnix-run", "emptyDir": {}},
        # vLLM's workers exchange tensors through /dev/shm; the container default (64 MiB) is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict] = [
        {"name": "llumnix-run", "mountPath": SOCKET_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    model = model_volume(source)
    if model is not None:
        volumes.append(model[0])
        mounts.append(model[1])
    return volumes, mounts


def model_volume(source: ModelSource) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The model claim as a read-only volume and its mount at MODEL_MOUNT; None without a claim."""
    if not source.pvc:
        return None
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc, "readOnly": True}}
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.sub_path:
        mount["subPath"] = source.sub_path
    return volume, mount


def engine_pod_template(settings: ServiceSettings, config: BuildConfig) -> dict[str, Any]:
    """The pod every instance is created from, without the hash annotation."""
    spec, name = settings.spec, settings.name
    engine = spec.engine
    argv, env = engine_command(spec)
    volumes, mounts = _volumes(spec.model.source)
    image = engine.image or (config.image if engine.runtime == "sim" else config.vllm_image)
    engine_container = {
        "name": "engine",
        "image": image,
        "command": argv[:1],
        "args": argv[1:],
        # POD_IP first: later values refer to it.
        # The token: for the drain hook, which runs in this container too.
        "env": [POD_IP_VAR, *({"name": k, "value": v} for k, v in sorted(env.items())), *WRITABLE_ENV,
                token_env(name)],
        # No port: the engine's HTTP API listens on localhost (the llumlet fronts it); its KV receiver's
        # port is chosen at start and published to the llumlet in the handshake record.
        "resources": _resources(engine.resources),
        "volumeMounts": [*mounts, *WRITABLE_MOUNTS],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        # The engine must outlive the llumlet's drain: migrations read its KV cache.
        "lifecycle": {"preStop": _drain_hook(config)},
    }
    llumlet_container = {
        "name": "llumlet",
        "image": config.image,
        "command": ["python"],
        "args": [
            "-m",
            "llumlet",
            "--host",
            "0.0.0.0",  # the pod's own addresses (probes and peers use the pod IP)
            "--engine-url",
            f"http://127.0.0.1:{ENGINE_PORT}",  # the engine listens on localhost only
            "--snapshot-addr",
            SNAPSHOT_ADDR,
            "--http-port",
            str(LLUMLET_HTTP_PORT),
            "--grpc-port",
            str(LLUMLET_GRPC_PORT),
            "--shutdown-grace",
            "20",
            *settings.llumlet_args,
        ],
        "env": [
            POD_IP_VAR,
            {"name": INSTANCE_ID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *WRITABLE_ENV,
            token_env(name),  # required of every caller of this llumlet
        ],
        "ports": [
            {"name": "llumlet-http", "containerPort": LLUMLET_HTTP_PORT},
            {"name": "llumlet-grpc", "containerPort": LLUMLET_GRPC_PORT},
        ],
        "resources": container_resources(spec.llumlet_resources),
        "volumeMounts": [*mounts[:1], *WRITABLE_MOUNTS],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        # /health is 503 until the engine answers: a generous start-up window for model loading,
        # then readiness gates the headless Service (and so the router) and liveness restarts a hung pod.
        "startupProbe": _health_probe(5, 180),
        "readinessProbe": _health_probe(2, 2),
        "livenessProbe": _health_probe(10, 6),
        "lifecycle": {"preStop": _drain_hook(config)},
    }
    resources = engine.resources
    pod_spec: dict[str, Any] = {
        "serviceAccountName": service_account_name(name),
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": config.termination_grace_s,
        "restartPolicy": "Always",
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [engine_container, llumlet_container],
        "volumes": [*volumes, *copy.deepcopy(WRITABLE_VOLUMES)],
    }
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = config.pull_secrets()
    pod_spec.update(pod_placement(resources.placement))  # only the fields the spec sets
    return {"metadata": {"labels": labels(name, ENGINE)}, "spec": pod_spec}


def engine_pod(settings: ServiceSettings, config: BuildConfig) -> dict[str, Any]:
    """A new engine pod (the API server picks the name's suffix) carrying its template's hash."""
    template = engine_pod_template(settings, config)
    pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(template)}
    pod["metadata"].update(
        generateName=engine_pod_prefix(settings.name),
        namespace=settings.namespace,
        annotations={TEMPLATE_HASH_ANNOTATION: template_hash(template)},
    )
    return pod
