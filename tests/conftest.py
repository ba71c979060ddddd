"""Shared fixtures: small, hand-made table sets (the generator has its own tests)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardwise.planner.tables import TableSpec

# A plugin module the chart's tests also import from: marked before they import it, so
# its asserts are rewritten and pytest_plugins finds it already rewritten.
pytest.register_assert_rewrite("chart_helpers")


@pytest.fixture(autouse=True, scope="session")
def _own_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests never read or write the user's model cache (a calibrated model there would
    change which model `plan` picks), and never see a $SHARDWISE_MODEL: an empty cache
    of the session's own; subprocesses inherit it. A test that wants models in a cache
    points $SHARDWISE_MODEL_CACHE at its own directory."""
    saved = {k: os.environ.get(k) for k in ("SHARDWISE_MODEL_CACHE", "SHARDWISE_MODEL")}
    root = tmp_path_factory.mktemp("model-cache")
    os.environ["SHARDWISE_MODEL_CACHE"] = str(root)
    os.environ.pop("SHARDWISE_MODEL", None)
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_tables(count: int, seed: int = 0) -> list[TableSpec]:
    """Varied tables: rows 1e3..1e6, widths 16..128, pooling 1..40."""
    rng = random.Random(seed)
    return [
        TableSpec(
            name=f"t{i}",
            rows=int(10 ** rng.uniform(3, 6)),
            dim=rng.choice([16, 32, 64, 128]),
            pooling_factor=round(rng.uniform(1, 40), 2),
            dtype=rng.choice(["fp32", "fp32", "fp16"]),
        )
        for i in range(count)
    ]


@pytest.fixture
def tables20() -> list[TableSpec]:
    return make_tables(20)
