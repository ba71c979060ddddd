"""Shared fixtures: small, hand-made table sets (the generator has its own tests)."""

from __future__ import annotations

import os

# One intra-op thread in every test process and every process it starts (torchrun ranks,
# the CLI, planner pools): the suite runs one xdist worker per core, so a second torch
# thread per worker only spins on the other worker's core. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from shardwise.planner.tables import TableSpec

#: The repository's root: scripts/ and benchmarks/ are files there, not modules.
ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at ``ROOT/relative`` as a module, registered under its file's stem
    (a dataclass in it looks its module up)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


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


def host_budget(tables: list[TableSpec], global_batch: int, floor: float, rounds: int) -> float:
    """``floor`` seconds on a quiet host, or ``rounds`` rounds of ``tables``' kernels as
    this host times them now, whichever is more: a test of measured refinement pins what
    it does with its time, so it gives the time a user would on a busy host. Beside two
    busy loops and other tests a kernel measured 89 ms where it measures 12 ms quiet, and
    a 6-s budget was spent before a single candidate ("time budget reached (0 candidates
    tried)"). One round is every table once, timed as refinement times a rank
    (``WARMUPS + ITERS`` calls), after one untimed call: a process's first kernel also
    pays for growing its heap."""
    import time

    from shardwise.profiler.compute import ShardLoad, measure_compute
    from shardwise.profiler.refine.placement import ITERS, WARMUPS

    loads = [ShardLoad.whole(t) for t in tables]
    measure_compute(loads, global_batch, warmups=0, iters=1)
    start = time.perf_counter()
    measure_compute(loads, global_batch, warmups=WARMUPS, iters=ITERS)
    return max(floor, rounds * (time.perf_counter() - start))


@pytest.fixture
def tables20() -> list[TableSpec]:
    return make_tables(20)


# --- Tiers and order (docs/testing.md) -------------------------------------------------
#: Modules whose every test starts processes: torchrun ranks, the `shardwise` CLI, a
#: real Prometheus or helm, a model trained for real. They belong to the full suite,
#: not to the inner loop's fast tier (`make check`).
PROCESS_MODULES = frozenset(
    {
        "test_cli",
        "test_cli_calibrate",
        "test_observability",
        "test_observability_operator",
        "test_profiler_comm",
        "test_profiler_pretrain",
    }
)
#: Fixtures that run a system rather than a function: kopf's engine on a thread against
#: the HTTP emulator, or the local kubelet's worker processes.
SYSTEM_FIXTURES = frozenset({"start_operator", "local_cluster"})


def tier(item: pytest.Item) -> tuple[bool, bool]:
    """(slow, e2e) for one test: its own marks, else what its module or fixtures run."""
    module = item.path.stem
    e2e = item.get_closest_marker("e2e") is not None or module.startswith("test_e2e_")
    slow = (
        e2e
        or item.get_closest_marker("slow") is not None
        or module in PROCESS_MODULES
        or module.startswith("test_runtime_")
        or bool(SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())))
    )
    return slow, e2e


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--scenarios",
        action="store_true",
        help="also run the closed loop's scenarios marked `scenario`, and hold every "
        "scenario to its targets (`make scenarios`: a machine of their own)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test's tier, then start the longest first: end-to-end runs, then the
    other slow ones, then the rest (a stable sort keeps each group's file order). With
    `pytest -n` and work stealing, the last minutes are then short tests spread over
    every worker, not one worker finishing a two-minute scenario alone. Tests marked
    `scenario` run only with `--scenarios`."""
    if not config.getoption("--scenarios"):
        left = [it for it in items if it.get_closest_marker("scenario") is not None]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [it for it in items if it.get_closest_marker("scenario") is None]
    ranks: dict[str, int] = {}
    for item in items:
        slow, e2e = tier(item)
        if e2e and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)
        if slow and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        ranks[item.nodeid] = 0 if e2e else 1 if slow else 2
    items.sort(key=lambda it: ranks[it.nodeid])
