"""What the builders need beyond the LLMService spec: the images, their pull secrets and the drain
timing. The operator reads them from its environment (the Helm chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llumnix import __version__
from llumnix.vllm_support import VLLM_VERSION
from llumnix_operator.network_policy import NETWORK_POLICY_ENV, NetworkPolicyConfig

IMAGE_ENV = "LLUMNIX_IMAGE"
VLLM_IMAGE_ENV = "LLUMNIX_VLLM_IMAGE"
IMAGE_PULL_SECRETS_ENV = "LLUMNIX_IMAGE_PULL_SECRETS"


@dataclass(frozen=True, slots=True)
class BuildConfig:
    image: str = f"ghcr.io/llumnix/llumnix:{__version__}"
    """The project image: operator, router, llumlet and sim engine."""
    vllm_image: str = f"ghcr.io/llumnix/llumnix-vllm:{__version__}-vllm{VLLM_VERSION}"
    """Engine image for runtime vllm/vllm-cpu when the spec names none: this project on the vLLM release
    its connector supports (the Dockerfile's BASE), which the tag names."""
    drain_timeout_s: int = 150
    """How long a pod being deleted may take to migrate its requests away."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (in each LLMService's namespace) the engine and router pods pull their images with."""
    network_policy: NetworkPolicyConfig | None = None
    """None: the engine pods get no NetworkPolicy."""

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
            image_pull_secrets=tuple(
                name for name in os.environ.get(IMAGE_PULL_SECRETS_ENV, "").split(",") if name
            ),
            network_policy=NetworkPolicyConfig.from_json(os.environ[NETWORK_POLICY_ENV])
            if os.environ.get(NETWORK_POLICY_ENV)
            else None,
        )

    def pull_secrets(self) -> list[dict[str, str]]:
        """The pod spec's `imagePullSecrets`."""
        return [{"name": name} for name in self.image_pull_secrets]
