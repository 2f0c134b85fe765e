"""Shared fixtures: the default model is loaded once per test session and shared by every engine."""

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel, load_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model(None, default_cache_dir())


@pytest.fixture(scope="session")
def make_engine(default_model: LoadedModel) -> Callable[..., Engine]:
    """Engine(EngineConfig(**overrides)) on the shared default model; small KV pool unless asked."""

    def make(**overrides: Any) -> Engine:
        overrides.setdefault("kv_cache_memory", 128 * 2**20)
        return Engine(EngineConfig(**overrides), model=default_model)

    return make
