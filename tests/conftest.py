"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llumnix.tiny_model import TinyModelRecipe, ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO_ROOT / ".cache" / "models"
REQUIRE_PROMETHEUS = "LLUMNIX_REQUIRE_PROMETHEUS"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default 2-layer test model, built once into .cache/models/ and reused while its recipe holds."""
    return ensure_tiny_model(MODEL_CACHE, TinyModelRecipe())


@pytest.fixture(scope="session")
def long_context_tiny_model_dir() -> Path:
    """The test model with 4,096 positions: requests long enough to outlive what a test does to them."""
    return ensure_tiny_model(MODEL_CACHE, TinyModelRecipe(max_position_embeddings=4096))


def prometheus_package_binary(name: str) -> str:
    """The path of `name` from Debian's prometheus package. Without it the test skips, or fails where
    LLUMNIX_REQUIRE_PROMETHEUS=1 (.ci/run), so that CI cannot pass without the Prometheus proof."""
    path = shutil.which(name)
    if path is not None:
        return path
    reason = (f"{name} not found: scripts/setup.sh installs Debian's prometheus package where apt-get "
              "can run as root (see docs/observability.md)")
    if os.environ.get(REQUIRE_PROMETHEUS) == "1":
        pytest.fail(f"{reason}; {REQUIRE_PROMETHEUS}=1 requires it", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def promtool_path() -> str:
    return prometheus_package_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_path() -> str:
    return prometheus_package_binary("prometheus")
