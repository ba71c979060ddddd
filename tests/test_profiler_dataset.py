"""The cost dataset: schema, resume after a crash, refusals, reading and hashing."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shardwise.basics import UserError
from shardwise.planner.tables import TableSpec
from shardwise.profiler.dataset.store import (
    MANIFEST_FILE,
    RECORDS_FILE,
    SCHEMA_VERSION,
    CommRecord,
    ComputeRecord,
    CostDataset,
    TableFeatures,
    coefficient_of_variation,
)
from shardwise.profiler.fingerprint import Fingerprint

FP = Fingerprint("cpu:Test CPU", "cpu", 2, "2.13.0+cpu", "1.8.0+cpu", "3.11.7")
SETTINGS = {"seed": 0, "batch_size": 512, "dims": (4, 8, 16), "max_tables": 15}
SPEC = TableSpec(name="t0-d16", rows=1000, dim=16, pooling_factor=3.5)


def compute_record(i: int) -> dict[str, Any]:
    return {
        "batch_size": 512,
        "tables": [TableFeatures.from_spec(SPEC).model_dump()],
        "fwd_s": 0.001 * (i + 1),
        "bwd_s": 0.002 * (i + 1),
        "total_s": 0.003 * (i + 1),
        "fwd_cv": 0.01,
        "bwd_cv": 0.02,
        "total_cv": 0.015,
        "repeats": 10,
    }


def comm_record(w: int = 2) -> dict[str, Any]:
    return {
        "batch_size": 512,
        "world_size": w,
        "dims": [16] * w,
        "delays_s": [0.0] * w,
        "fwd_s": [0.001] * w,
        "bwd_s": [0.001] * w,
        "fwd_cv": [0.01] * w,
        "bwd_cv": [0.01] * w,
        "repeats": 10,
    }


def write(d: Path, indices: range) -> None:
    with CostDataset.create_or_open(d, "compute", FP, SETTINGS) as ds:
        for i in indices:
            if i not in ds.done_indices():
                ds.append(i, compute_record(i))


def test_create_layout_and_manifest(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(3))
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["kind"] == "compute"
    assert manifest["fingerprint"] == dataclasses.asdict(FP)
    assert manifest["fingerprint_key"] == FP.key()
    assert manifest["settings"] == {**SETTINGS, "dims": [4, 8, 16]}
    assert manifest["created_at"].endswith("+00:00")
    lines = (d / RECORDS_FILE).read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["index"] == 0 and first["fingerprint"] == FP.key()
    assert first["tables"][0] == {
        "name": "t0-d16",
        "base": "t0",
        "rows": 1000,
        "dim": 16,
        "cols": 16,
        "pooling_factor": 3.5,
        "access_hist": [1.0] + [0.0] * 16,
        "dtype": "fp32",
    }


def test_resume_after_a_torn_write_loses_nothing(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(5))
    with open(d / RECORDS_FILE, "ab") as f:  # a crash in the middle of sample 5
        f.write(json.dumps({"index": 5, **compute_record(5)}).encode()[:57])
    reader = CostDataset.open(d)
    assert len(reader) == 5 and reader.done_indices() == set(range(5))  # reader ignores it

    with CostDataset.create_or_open(d, "compute", FP, SETTINGS) as ds:
        assert ds.recovered_bytes == 57
        assert ds.done_indices() == set(range(5))
        for i in range(8):
            if i not in ds.done_indices():
                ds.append(i, compute_record(i))
        assert len(ds) == 8
    records = CostDataset.open(d).load()
    assert [r["index"] for r in records] == list(range(8))
    assert [r["total_s"] for r in records] == [pytest.approx(0.003 * (i + 1)) for i in range(8)]
    assert (d / RECORDS_FILE).read_bytes().endswith(b"}\n")


def test_resume_is_identical_to_one_run(tmp_path: Path) -> None:
    write(tmp_path / "a", range(6))
    write(tmp_path / "b", range(3))
    write(tmp_path / "b", range(6))
    assert CostDataset.open(tmp_path / "a").dataset_hash() == (
        CostDataset.open(tmp_path / "b").dataset_hash()
    )


def test_damage_before_valid_records_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(3))
    lines = (d / RECORDS_FILE).read_bytes().splitlines(keepends=True)
    (d / RECORDS_FILE).write_bytes(lines[0] + b'{"index": 1, "garbage\n' + lines[2])
    with pytest.raises(UserError, match=r"records.jsonl, line 2: not a valid compute record"):
        CostDataset.create_or_open(d, "compute", FP, SETTINGS)
    with pytest.raises(UserError, match="line 2"):
        CostDataset.open(d).load()


def test_resume_keeps_complete_records_it_cannot_read(tmp_path: Path) -> None:
    """Only an unterminated last line is an interrupted write. 50 complete lines with an
    unknown key are somebody's edit: refused with the file, line and field, none cut."""
    d = tmp_path / "ds"
    write(d, range(300))
    lines = (d / RECORDS_FILE).read_text().splitlines(keepends=True)
    for k in range(250, 300):
        lines[k] = json.dumps({**json.loads(lines[k]), "note": "checked"}) + "\n"
    (d / RECORDS_FILE).write_text("".join(lines))
    before = (d / RECORDS_FILE).read_bytes()
    with pytest.raises(UserError) as err:
        CostDataset.create_or_open(d, "compute", FP, SETTINGS)
    msg = str(err.value)
    assert f"{d / RECORDS_FILE}, line 251: not a valid compute record" in msg
    assert "note: Extra inputs are not permitted" in msg
    assert "Nothing was deleted" in msg and "remove it" in msg
    assert (d / RECORDS_FILE).read_bytes() == before  # nothing cut
    with pytest.raises(UserError, match="line 251"):
        CostDataset.open(d).load()


def test_a_repeated_index_is_refused_with_both_lines(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(3))
    lines = (d / RECORDS_FILE).read_bytes().splitlines(keepends=True)
    (d / RECORDS_FILE).write_bytes(b"".join([*lines, lines[1]]))
    with pytest.raises(UserError, match=r"line 4: sample index 1 repeats \(first on line 2\)"):
        CostDataset.create_or_open(d, "compute", FP, SETTINGS)


def test_only_an_unterminated_last_line_is_cut(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(2))
    with open(d / RECORDS_FILE, "ab") as f:
        f.write(b"\x00\x00\x00")  # what a power cut can leave: the size grew, the data did not
    with CostDataset.create_or_open(d, "compute", FP, SETTINGS) as ds:
        assert ds.recovered_bytes == 3 and len(ds) == 2
    with open(d / RECORDS_FILE, "ab") as f:
        f.write(b"\x00\x00\x00\n")  # the newline was written too: not a torn write
    with pytest.raises(UserError, match=r"line 3: not a valid compute record \(the line: "):
        CostDataset.create_or_open(d, "compute", FP, SETTINGS)


def test_fingerprint_mismatch_is_refused_unless_allowed(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(2))
    other = dataclasses.replace(FP, device="cpu:Other CPU", cores=8)
    with pytest.raises(UserError) as err:
        CostDataset.create_or_open(d, "compute", other, SETTINGS)
    msg = str(err.value)
    assert "cannot be resumed" in msg and "cpu:Test CPU" in msg and "cpu:Other CPU" in msg
    assert "allow-mismatch" in msg
    with CostDataset.create_or_open(d, "compute", other, SETTINGS, allow_mismatch=True) as ds:
        ds.append(2, compute_record(2))
    reopened = CostDataset.open(d)
    assert reopened.fingerprint == FP  # the creator's stays the dataset's fingerprint
    assert set(reopened.manifest.fingerprints) == {FP.key(), other.key()}
    assert [r["fingerprint"] for r in reopened.load()] == [FP.key(), FP.key(), other.key()]
    # A python-only difference is not a mismatch.
    newer_python = dataclasses.replace(FP, python="3.11.9")
    CostDataset.create_or_open(d, "compute", newer_python, SETTINGS).close()


def test_settings_and_kind_mismatch_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(1))
    with pytest.raises(UserError, match=r"seed: stored 0, now 1"):
        CostDataset.create_or_open(d, "compute", FP, {**SETTINGS, "seed": 1})
    with pytest.raises(UserError, match="holds a compute dataset"):
        CostDataset.create_or_open(d, "comm", FP, SETTINGS)
    with CostDataset.create_or_open(
        d, "compute", FP, {**SETTINGS, "seed": 1}, allow_mismatch=True
    ) as ds:
        assert ds.manifest.other_settings[0]["seed"] == 1


def test_refuses_foreign_dirs_and_other_schema_versions(tmp_path: Path) -> None:
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a Shardwise cost dataset"):
        CostDataset.create_or_open(tmp_path / "foreign", "compute", FP, SETTINGS)
    with pytest.raises(UserError, match="not a Shardwise cost dataset"):
        CostDataset.open(tmp_path / "nothing")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        CostDataset.create_or_open(tmp_path / "a-file", "compute", FP, SETTINGS)
    d = tmp_path / "ds"
    write(d, range(1))
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(UserError, match="schema version 99"):
        CostDataset.open(d)


@pytest.mark.parametrize(
    ("fingerprint", "field", "fragment"),
    [
        ({**dataclasses.asdict(FP), "device_type": "gpu"}, "device_type", "'cpu' or 'cuda'"),
        ({**dataclasses.asdict(FP), "cores": "abc"}, "cores", "whole number >= 1, got 'abc'"),
        ({**dataclasses.asdict(FP), "cores": True}, "cores", "whole number"),
        ({}, "fingerprint", "missing device, device_type, cores"),
        ({**dataclasses.asdict(FP), "colour": "red"}, "colour", "unknown field"),
    ],
)
def test_a_malformed_fingerprint_is_a_user_error_naming_the_field(
    tmp_path: Path, fingerprint: dict[str, Any], field: str, fragment: str
) -> None:
    d = tmp_path / "ds"
    write(d, range(1))
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    (d / MANIFEST_FILE).write_text(json.dumps({**manifest, "fingerprint": fingerprint}, indent=1))
    for attempt in (
        lambda: CostDataset.open(d),
        lambda: CostDataset.create_or_open(d, "compute", FP, SETTINGS),
    ):
        with pytest.raises(UserError) as err:
            attempt()
        msg = str(err.value)
        assert msg.startswith(f"{d / MANIFEST_FILE}: not a valid dataset manifest")
        assert field in msg and fragment in msg and "line " in msg
        assert "--repair" in msg  # how to fix it, besides editing the field


def test_manifest_errors_name_the_line_of_the_field(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(1))
    text = (d / MANIFEST_FILE).read_text()
    line = next(n for n, t in enumerate(text.splitlines(), 1) if '"cores"' in t)
    (d / MANIFEST_FILE).write_text(text.replace('"cores": 2', '"cores": -2', 1))
    with pytest.raises(UserError, match=rf"line {line}, fingerprint.cores: must be a whole"):
        CostDataset.open(d)
    (d / MANIFEST_FILE).write_text(text.replace('"seed": 0', '"seed": NaN', 1))
    with pytest.raises(UserError, match=r"settings: holds NaN"):
        CostDataset.open(d)


def test_records_without_their_manifest_say_how_to_rebuild_it(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(2))
    (d / MANIFEST_FILE).unlink()
    before = (d / RECORDS_FILE).read_bytes()
    for attempt in (
        lambda: CostDataset.open(d),
        lambda: CostDataset.create_or_open(d, "compute", FP, SETTINGS),
    ):
        with pytest.raises(UserError) as err:
            attempt()
        msg = str(err.value)
        assert f"{d / MANIFEST_FILE} is missing" in msg and "was deleted or lost" in msg
        assert "--repair" in msg and "move records.jsonl away" in msg
    assert (d / RECORDS_FILE).read_bytes() == before and not (d / MANIFEST_FILE).exists()


def test_repair_rebuilds_the_manifest_only_when_every_record_agrees(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(4))
    hash_before = CostDataset.open(d).dataset_hash()
    (d / MANIFEST_FILE).unlink()

    def by_batch(rec: Any) -> str | None:
        return None if rec.batch_size == 512 else "another batch"

    other = dataclasses.replace(FP, device="cpu:Other CPU")
    with pytest.raises(UserError, match=r"line 1 \(sample 0\): measured on the machine"):
        CostDataset.repair(d, "compute", other, SETTINGS, by_batch)
    with pytest.raises(UserError, match=r"4 of 4 records disagree.*\n  line 1 \(sample 0\): no"):
        CostDataset.repair(d, "compute", FP, SETTINGS, lambda rec: "no")
    with pytest.raises(UserError, match=r"holds compute records.*`shardwise profile compute"):
        CostDataset.repair(d, "comm", FP, SETTINGS, by_batch)
    assert not (d / MANIFEST_FILE).exists()  # nothing written on a refusal

    assert CostDataset.repair(d, "compute", FP, SETTINGS, by_batch) == 4
    assert CostDataset.open(d).dataset_hash() == hash_before
    assert CostDataset.repair(d, "compute", FP, SETTINGS, by_batch) == 0  # nothing to do
    write(d, range(6))  # and it resumes


def test_an_interrupted_create_is_taken_over(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    (d / RECORDS_FILE).touch()  # crashed before the manifest was written
    (d / f"{MANIFEST_FILE}.0123abcd.tmp").write_text("{")  # ... or while renaming it
    write(d, range(2))
    assert len(CostDataset.open(d)) == 2
    assert sorted(p.name for p in d.iterdir()) == [MANIFEST_FILE, RECORDS_FILE]


def test_append_validates_and_refuses_duplicates(tmp_path: Path) -> None:
    with CostDataset.create_or_open(tmp_path / "ds", "compute", FP, SETTINGS) as ds:
        ds.append(0, compute_record(0))
        with pytest.raises(ValueError, match="already"):
            ds.append(0, compute_record(0))
        with pytest.raises(ValidationError):
            ds.append(1, {**compute_record(1), "fwd_s": float("nan")})
        with pytest.raises(ValidationError):
            ds.append(1, {**compute_record(1), "surprise": 1})
        with pytest.raises(ValueError, match="differs"):
            ds.append(1, {**compute_record(1), "index": 2})
        rec = ds.append(1, ComputeRecord(index=1, fingerprint="x", **compute_record(1)))
        assert rec.fingerprint == "x"
        assert len(ds) == 2
    with pytest.raises(RuntimeError, match="not open for writing"):
        CostDataset.open(tmp_path / "ds").append(5, compute_record(5))


def _hold_lock(d: str, ready: Any, release: Any) -> None:
    with CostDataset.create_or_open(d, "compute", FP, SETTINGS):
        ready.set()
        release.wait(10)


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    write(d, range(1))
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(d), ready, release))
    proc.start()
    try:
        assert ready.wait(10)
        with pytest.raises(UserError, match="another process"):
            CostDataset.create_or_open(d, "compute", FP, SETTINGS)
    finally:
        release.set()
        proc.join(10)
    write(d, range(2))  # the lock went with the other writer


def test_comm_records(tmp_path: Path) -> None:
    with CostDataset.create_or_open(tmp_path / "c", "comm", FP, {"seed": 0}) as ds:
        ds.append(0, comm_record(2))
        ds.append(1, comm_record(4))
        with pytest.raises(ValidationError, match="one per rank"):
            ds.append(2, {**comm_record(4), "fwd_s": [0.1]})
        with pytest.raises(ValidationError, match="multiples of 4"):
            ds.append(2, {**comm_record(2), "dims": [3, 4]})
    loaded = CostDataset.open(tmp_path / "c").load()
    assert [r["world_size"] for r in loaded] == [2, 4]
    assert isinstance(next(CostDataset.open(tmp_path / "c").models()), CommRecord)


def test_reading_and_hash(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    with CostDataset.create_or_open(d, "compute", FP, SETTINGS) as ds:
        for i in (2, 0, 1):  # out of order: load() sorts, the hash ignores order
            ds.append(i, compute_record(i))
        writer_hash = ds.dataset_hash()
    reader = CostDataset.open(d)
    assert [r["index"] for r in reader.records()] == [2, 0, 1]
    assert [r["index"] for r in reader.load()] == [0, 1, 2]
    assert set(reader.by_index()) == {0, 1, 2}
    assert reader.dataset_hash() == writer_hash
    assert len(writer_hash) == 64
    write(tmp_path / "ordered", range(3))
    assert CostDataset.open(tmp_path / "ordered").dataset_hash() == writer_hash
    with CostDataset.create_or_open(d, "compute", FP, SETTINGS) as ds:
        ds.append(3, compute_record(3))
    assert CostDataset.open(d).dataset_hash() != writer_hash


def test_coefficient_of_variation() -> None:
    assert coefficient_of_variation([1.0]) == 0.0
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(2**0.5 / 2)
