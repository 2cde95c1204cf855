"""What the builders need beyond the LLMService spec: the images and the drain timing. The operator
reads them from its environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llumnix import __version__

IMAGE_ENV = "LLUMNIX_IMAGE"
VLLM_IMAGE_ENV = "LLUMNIX_VLLM_IMAGE"


@dataclass(frozen=True, slots=True)
class BuildConfig:
    image: str = f"ghcr.io/llumnix/llumnix:{__version__}"
    """The project image: operator, router, llumlet and sim engine."""
    vllm_image: str = f"ghcr.io/llumnix/llumnix-vllm:{__version__}"
    """Engine image for runtime vllm/vllm-cpu when the spec names none (vLLM + this project)."""
    drain_timeout_s: int = 150
    """How long a pod being deleted may take to migrate its requests away."""

    @property
    def termination_grace_s(self) -> int:
        # Longer than the drain, so the kubelet never kills a pod mid-migration.
        return self.drain_timeout_s + 30

    @classmethod
    def from_env(cls) -> BuildConfig:
        defaults = cls()
        return cls(
            image=os.environ.get(IMAGE_ENV, defaults.image),
            vllm_image=os.environ.get(VLLM_IMAGE_ENV, defaults.vllm_image),
        )
