"""Runs started at once into one new dataset directory, and concurrent atomic writes:
real threads and processes behind a barrier, many trials (docs/design.md §6)."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path
from typing import Any

from test_profiler_dataset import FP, compute_record

from shardwise.basics import UserError, write_atomic
from shardwise.profiler.dataset.store import MANIFEST_FILE, RECORDS_FILE, CostDataset

TRIALS_THREADS = 60
TRIALS_PROCESSES = 12


def _create(d: Path, k: int, start: Any, tried: Any) -> str:
    """Writer ``k`` with its own settings: 'ok' (it appended sample 0, marked with ``k``)
    or the exception it met. Holds the dataset open until every writer has tried, so
    that a loser cannot simply come after the winner."""
    start.wait(10)
    try:
        ds = CostDataset.create_or_open(d, "compute", FP, {"seed": k})
    except UserError as err:
        tried.wait(10)
        return f"UserError: {err}"
    except BaseException as err:  # what the test must never see
        tried.wait(10)
        return f"{type(err).__name__}: {err}"
    with ds:
        ds.append(0, {**compute_record(0), "extra": {"writer": k}})
        tried.wait(10)
    return "ok"


def _check(d: Path, outcomes: list[str]) -> None:
    winners = [k for k, o in enumerate(outcomes) if o == "ok"]
    assert len(winners) == 1, outcomes
    for o in outcomes:
        assert o == "ok" or (o.startswith("UserError: ") and "another process" in o), outcomes
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    records = CostDataset.open(d).load()
    # The survivor's records sit under the survivor's settings.
    assert manifest["settings"] == {"seed": winners[0]}
    assert [r["extra"]["writer"] for r in records] == winners
    assert sorted(p.name for p in d.iterdir()) == [MANIFEST_FILE, RECORDS_FILE]


def test_two_threads_creating_one_dataset(tmp_path: Path) -> None:
    for trial in range(TRIALS_THREADS):
        d = tmp_path / f"t{trial}"
        start, tried = threading.Barrier(2), threading.Barrier(2)
        outcomes = ["", ""]

        def run(k: int, d: Path = d, b: Any = (start, tried), out: Any = outcomes) -> None:
            out[k] = _create(d, k, *b)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        _check(d, outcomes)


def _in_process(d: str, k: int, start: Any, tried: Any, results: Any) -> None:
    results.put((k, _create(Path(d), k, start, tried)))


def test_two_processes_creating_one_dataset(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for trial in range(TRIALS_PROCESSES):
        d = tmp_path / f"p{trial}"
        start, tried, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=_in_process, args=(str(d), k, start, tried, results))
            for k in range(2)
        ]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(30)
        _check(d, [got[0], got[1]])


def test_concurrent_atomic_writes_of_one_file(tmp_path: Path) -> None:
    """Every writer's rename succeeds and the file is one writer's text, whole; no
    temporary file is left behind."""
    path = tmp_path / "shared.json"
    texts = [json.dumps({"writer": k, "pad": "x" * (1000 * k)}) for k in range(4)]
    for _ in range(40):
        barrier = threading.Barrier(len(texts))
        errors: list[BaseException] = []

        def run(text: str, barrier: Any = barrier, errors: Any = errors) -> None:
            barrier.wait(10)
            try:
                write_atomic(path, text)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=run, args=(t,)) for t in texts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert path.read_text() in texts
        assert [p.name for p in tmp_path.iterdir()] == [path.name]
