"""Fixtures shared by the whole test suite."""

import os
import pathlib

import pytest

from common.tiny_model import ensure_tiny_model, recipe_id

# Set to a folder to keep the tiny models between test sessions; the folder names carry the build recipe, so a
# changed build never reuses a stale copy.
TINY_MODEL_CACHE_ENV = "MMCAST_TINY_MODEL_CACHE"


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, variant: str) -> pathlib.Path:
    cache = os.environ.get(TINY_MODEL_CACHE_ENV)
    root = pathlib.Path(cache) if cache else tmp_path_factory.getbasetemp()
    return ensure_tiny_model(root / f"tiny-{variant}-seed0-{recipe_id()}", variant=variant, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny Qwen2-VL (seed 0), built once per session."""
    return _tiny_model(tmp_path_factory, "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_model_25_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Folder of the embedded tiny Qwen2.5-VL (seed 0), built once per session."""
    return _tiny_model(tmp_path_factory, "qwen2_5_vl")
