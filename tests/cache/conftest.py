"""The disk tier's fixtures: a no-cache reference engine, and the engines a test made (closed at its end)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import (
    engine_with_blocks,
)


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Engine:
    return engine_with_blocks(tiny_model, 512, 16, enable_prefix_caching=False)


@pytest.fixture
def engines(tiny_model: LoadedModel, tmp_path: Path) -> Iterator[list[Engine]]:
    """Engines made by `disk_engine`; each is closed (its writes finished) at the end."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()
