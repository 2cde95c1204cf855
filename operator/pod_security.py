"""The Pod Security "restricted" profile for every pod the operator creates (engine pods and the
router's): non-root, no privilege escalation, every capability dropped, the runtime's default
seccomp profile. The images' file systems are not assumed writable for that user, so the caches
vLLM, Hugging Face, Triton and torch write to live on emptyDirs (HOME and /tmp)."""

from __future__ import annotations

from typing import Any

RUN_AS_USER = 1000
HOME_DIR = "/var/lib/llumnix"

POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}

CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}

WRITABLE_VOLUMES: list[dict[str, Any]] = [
    {"name": "home", "emptyDir": {}},
    {"name": "tmp", "emptyDir": {}},
]
WRITABLE_MOUNTS: list[dict[str, Any]] = [
    {"name": "home", "mountPath": HOME_DIR},
    {"name": "tmp", "mountPath": "/tmp"},
]
WRITABLE_ENV: list[dict[str, str]] = [
    # ~/.cache/{vllm,huggingface}, ~/.triton, ~/.config/vllm all resolve under HOME.
    {"name": "HOME", "value": HOME_DIR},
    {"name": "XDG_CACHE_HOME", "value": f"{HOME_DIR}/.cache"},
]
