"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from llumnix.tiny_model import TinyModelRecipe, ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO_ROOT / ".cache" / "models"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default 2-layer test model, built once into .cache/models/ and reused while its recipe holds."""
    return ensure_tiny_model(MODEL_CACHE, TinyModelRecipe())


@pytest.fixture(scope="session")
def long_context_tiny_model_dir() -> Path:
    """The test model with 4,096 positions: requests long enough to outlive what a test does to them."""
    return ensure_tiny_model(MODEL_CACHE, TinyModelRecipe(max_position_embeddings=4096))
