"""The per-machine model cache (planner/costmodel/cache.py), table signatures and the
batch-range check: which model is chosen, what is skipped and said, atomic writes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tables
from model_cache_helpers import FINGERPRINT, KEY, calibrated

from shardwise.basics import UserError
from shardwise.planner.costmodel import (
    ENV_CACHE,
    CostModel,
    ModelCache,
    ModelChoice,
    artifact,
    batch_note,
    cache_root,
    trained_batches,
)
from shardwise.planner.costmodel.cache import entry_name
from shardwise.planner.tables import TableSpec, table_signature, tables_signatures

TABLES = make_tables(6)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Never the user's ~/.cache: every test gets its own cache root."""
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV_CACHE, str(root))
    monkeypatch.delenv("SHARDWISE_MODEL", raising=False)
    return root


class Warnings(list[str]):
    def __call__(self, line: str) -> None:
        assert "\n" not in line, line
        self.append(line)


# --------------------------------------------------------------------------- signatures
def test_signature_is_what_the_cost_depends_on_not_the_name() -> None:
    t = TableSpec(name="a", rows=1000, dim=16, pooling_factor=3.0)
    sig = table_signature(t)
    assert len(sig) == 16 and int(sig, 16) >= 0
    assert table_signature(t.model_copy(update={"name": "other"})) == sig
    assert table_signature(t.model_copy(update={"pooling_factor": 3.00001})) == sig  # 4 digits
    hist = (0.5, 0.5) + (0.0,) * 15
    near = (0.50001, 0.49999) + (0.0,) * 15
    assert table_signature(t.model_copy(update={"access_hist": hist})) == table_signature(
        t.model_copy(update={"access_hist": near})
    )
    changed = [
        {"rows": 1001},
        {"dim": 20},
        {"dtype": "fp16"},
        {"pooling_factor": 3.01},
        {"access_hist": hist},
    ]
    sigs = {table_signature(t.model_copy(update=u)) for u in changed}
    assert sig not in sigs and len(sigs) == len(changed)


def test_signatures_are_sorted_unique_and_stable_across_processes() -> None:
    twins = [TABLES[0], TABLES[0].model_copy(update={"name": "twin"}), *TABLES[1:]]
    sigs = tables_signatures(twins)
    assert sigs == sorted(set(sigs)) and len(sigs) == len(TABLES)
    code = (
        "import sys; from shardwise.planner.tables import TableSpec, table_signature; "
        "print(table_signature(TableSpec(name='x', rows=1000, dim=16, pooling_factor=3.0)), "
        "'torch' in sys.modules)"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    here = table_signature(TableSpec(name="x", rows=1000, dim=16, pooling_factor=3.0))
    assert outs == {f"{here} False\n"}  # one value in every process; no torch imported


# --------------------------------------------------------------------------- where
def test_root_env_then_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv(ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "shardwise" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "shardwise" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ModelCache().root == tmp_path / "home" / ".cache" / "shardwise" / "models"


# --------------------------------------------------------------------------- store
def test_store_writes_the_entry_named_by_its_tables(tmp_path: Path) -> None:
    model = calibrated(TABLES)
    path = ModelCache().store(model, KEY)
    assert path == tmp_path / "cache" / KEY / entry_name(tables_signatures(TABLES))
    assert path.name.startswith("calibrated-") and len(path.stem) == len("calibrated-") + 16
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left
    back = CostModel.load(path)
    assert back.metadata["calibration"] == model.metadata["calibration"]
    x = torch.zeros(3, len(back.compute.table_norm.mean))
    assert torch.equal(back.compute.encoder(x), model.compute.encoder(x))


def test_store_refuses_what_is_no_entry_of_that_machine() -> None:
    cache = ModelCache()
    plain = calibrated(TABLES)
    del plain.metadata["calibration"]
    with pytest.raises(UserError, match="no metadata.calibration"):
        cache.store(plain, KEY)
    with pytest.raises(UserError, match="calibrated on machine 0123456789abcdef, not"):
        cache.store(calibrated(TABLES), "fedcba9876543210")
    with pytest.raises(UserError, match="not a hardware fingerprint key"):
        cache.store(calibrated(TABLES), "../escape")


def test_store_into_an_unwritable_place_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write the cached cost model"):
        ModelCache(tmp_path / "file").store(calibrated(TABLES), KEY)


def _store_many(root: str, seed: int, start: Any) -> None:
    start.wait()
    model = calibrated(TABLES, seed=seed)
    for _ in range(15):
        ModelCache(Path(root)).store(model, KEY)


def test_two_writers_of_one_entry_leave_one_whole(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(2)
    root = tmp_path / "cache"
    procs = [ctx.Process(target=_store_many, args=(str(root), s, start)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (entry,) = (root / KEY).iterdir()  # no temporary file left behind
    back = CostModel.load(entry)
    seed = back.metadata["seed"]
    assert seed in (1, 2)
    want = calibrated(TABLES, seed=seed).compute.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in back.compute.state_dict().items())


# --------------------------------------------------------------------------- select
def test_full_coverage_newest_wins_then_most_covered_then_bundled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = ModelCache()
    warn = Warnings()
    assert cache.best(KEY, TABLES, warn) is None
    bundled = cache.select(KEY, TABLES, warn)
    assert bundled.origin == "bundled" and bundled.path is None and not bundled.calibrated_here
    assert "the bundled CPU model (not calibrated" in bundled.note

    half = cache.store(calibrated(TABLES[:3]), KEY)
    more = cache.store(calibrated(TABLES[:5], created="2026-01-01T00:00:00+00:00"), KEY)
    choice = cache.best(KEY, TABLES, warn)
    assert choice is not None and choice.path == more and (choice.covers, choice.of) == (5, 6)
    assert "calibrated on this machine on 5 of these 6 tables, the closest" in choice.note
    assert not choice.holds_here

    cache.store(calibrated(TABLES, created="2026-01-02T00:00:00+00:00"), KEY)
    new = cache.store(calibrated([*TABLES, *make_tables(2, seed=9)], created="2026-02-01"), KEY)
    choice = cache.best(KEY, TABLES, warn)
    assert choice is not None and choice.path == new  # both cover all: the newest
    assert choice.holds_here and choice.calibrated_here and (choice.covers, choice.of) == (6, 6)
    assert (
        choice.note
        == f"cost model: {new} (calibrated on this machine on 6 of these 6 tables, 2026-02-01)"
    )
    assert cache.select(KEY, TABLES[:3], warn).path == half  # all three cover it: newest
    assert warn == []
    # Another machine sees none of them.
    assert cache.best("fedcba9876543210", TABLES, warn) is None


def test_damaged_foreign_and_misplaced_files_are_skipped_with_one_line_each(
    tmp_path: Path,
) -> None:
    cache = ModelCache()
    good = cache.store(calibrated(TABLES[:2]), KEY)
    folder = good.parent
    (folder / "garbage.pt").write_bytes(b"not a torch file at all")
    (folder / "empty.pt").write_bytes(b"")
    (folder / "truncated.pt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save({"weights": torch.ones(2)}, folder / "foreign.pt")
    payload = calibrated(TABLES).to_payload()
    payload["format_version"] = 99
    torch.save(payload, folder / "future.pt")
    calibrated(TABLES, key="fedcba9876543210").save(folder / "moved.pt")
    plain = calibrated(TABLES)
    del plain.metadata["calibration"]
    plain.save(folder / "plain.pt")
    (folder / "notes.txt").write_text("ignored: not a model file")
    (folder / ".calibrated-x.pt.abc.tmp").write_bytes(b"half written")  # another writer's
    warn = Warnings()
    choice = cache.best(KEY, TABLES, warn)
    assert choice is not None and choice.path == good  # the 6-table files were never used
    said = {
        line.split(": ")[0].removeprefix("skipped the cached cost model "): line for line in warn
    }
    names = {"empty", "foreign", "future", "garbage", "moved", "plain", "truncated"}
    assert set(said) == {str(folder / f"{n}.pt") for n in names}
    assert "empty or truncated" in said[str(folder / "empty.pt")]
    assert "truncated or corrupt" in said[str(folder / "truncated.pt")]
    assert ": it is a torch file but not a Shardwise cost model" in said[str(folder / "foreign.pt")]
    assert "format version 99" in said[str(folder / "future.pt")]
    assert "calibrated on machine fedcba9876543210" in said[str(folder / "moved.pt")]
    assert "holds no calibration" in said[str(folder / "plain.pt")]
    assert all(line.endswith("Delete it; `shardwise calibrate` writes a new one.") for line in warn)
    # Only bad files: the bundled model, never a crash.
    good.unlink()
    warn.clear()
    assert cache.select(KEY, TABLES, warn).origin == "bundled" and len(warn) == len(names)


def test_unreadable_cache_folder_is_a_warning(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    (root / KEY).write_text("a file where the folder should be")
    warn = Warnings()
    assert ModelCache().best(KEY, TABLES, warn) is None and warn == []
    if os.geteuid() == 0:
        return  # root reads anything: no permission error to provoke
    (root / KEY).unlink()
    (root / KEY).mkdir(mode=0)
    assert ModelCache().best(KEY, TABLES, warn) is None and "cannot read" in warn[0]


def test_a_missing_bundled_model_is_the_error_that_says_make_pretrain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(artifact, "BUNDLED_MODEL", tmp_path / "nope.pt")
    with pytest.raises(UserError, match="make pretrain"):
        ModelCache().select(KEY, TABLES, Warnings())


def test_choice_of_a_model_from_another_machine_says_so() -> None:
    other = {**FINGERPRINT, "device": "cpu:Other CPU", "cores": 64}
    model = calibrated(TABLES, key="fedcba9876543210", fingerprint=other)
    choice = ModelChoice.of_model(model, Path("/m.pt"), "--model", KEY, TABLES[:4])
    assert not choice.calibrated_here and not choice.holds_here
    assert (choice.covers, choice.of) == (4, 4)
    assert choice.note == (
        "cost model: /m.pt (given by --model; calibrated on another machine, cpu:Other CPU "
        "(64 cores), on 4 of these 4 tables, 2026-11-24; not for this machine)"
    )
    pretrained = CostModel(
        model.compute, None, {"fingerprint": FINGERPRINT, "fingerprint_key": KEY}
    )
    here = ModelChoice.of_model(pretrained, None, "bundled", KEY, TABLES)
    assert "pre-trained on this machine's hardware, not calibrated on these tables" in here.note
    damaged = CostModel(model.compute, None, {"calibration": {"tables": "oops"}})
    assert ModelChoice.of_model(damaged, None, "bundled", KEY, TABLES).covers == 0


# --------------------------------------------------------------------------- batch range
def test_trained_batches_are_the_union_and_skip_junk() -> None:
    meta = {"batch_sizes": [1024, 256, True, -4, "x"], "calibration": {"batch_sizes": [65536]}}
    assert trained_batches(meta) == [256, 1024, 65536]
    assert trained_batches({"calibration": "damaged"}) == []
    assert trained_batches(calibrated(TABLES).metadata) == [256, 512, 1024]


def test_batch_note_inside_outside_and_the_jobs_own_batch() -> None:
    trained = [256, 512, 2048]
    assert batch_note(trained, 256) is None and batch_note(trained, 2048) is None
    assert batch_note(trained, 1000) is None  # between trained batches: interpolation
    line = batch_note(trained, 65536, calibrate="shardwise calibrate --tables t.yaml")
    assert line == (
        "note: the model was trained on global batches 256–2,048; 65,536 is outside: "
        "predictions extrapolate. Calibrate at this batch: `shardwise calibrate --tables t.yaml`."
    )
    low = batch_note(trained, 128)
    assert low is not None and "128 is outside" in low and "Calibrate" not in low
    job = batch_note(trained, 1024, job_batch=524288)
    assert job is not None and "priced at 1,024, inside it" in job and "524,288, outside" in job
    assert batch_note(trained, 1024, job_batch=2048) is None
    both = batch_note(trained, 4096, job_batch=524288)
    assert both is not None and "(and so is the job's 524,288)" in both
    one = batch_note([1024], 8192)
    assert one is not None and "global batch 1,024;" in one
    unknown = batch_note([], 1024)
    assert unknown is not None and "records no global batches" in unknown
