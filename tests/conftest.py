"""Shared fixtures: small, hand-made table sets (the generator has its own tests)."""

from __future__ import annotations

import random

import pytest

from shardwise.planner.tables import TableSpec

# A plugin module the chart's tests also import from: marked before they import it, so
# its asserts are rewritten and pytest_plugins finds it already rewritten.
pytest.register_assert_rewrite("chart_helpers")


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
