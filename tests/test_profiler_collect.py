"""The profiling loops: real measurements appended one by one, resumable after Ctrl-C."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.profiler.collect import profile_comm, profile_compute
from shardwise.profiler.dataset.store import MANIFEST_FILE, CostDataset
from shardwise.profiler.fingerprint import current_fingerprint

TABLES = [t.model_copy(update={"rows": min(t.rows, 20_000)}) for t in make_tables(6, seed=5)]


def test_compute_resumes_after_an_interrupt(tmp_path: Path) -> None:
    out = tmp_path / "compute"
    seen: list[int] = []

    def stop_after_two(i: int) -> None:
        seen.append(i)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        profile_compute(TABLES, out, 5, batch_sizes=[128, 64], on_sample=stop_after_two)
    ds = CostDataset.open(out)
    assert sorted(ds.done_indices()) == [0, 1]  # both finished samples kept

    summary = profile_compute(TABLES, out, 5, batch_sizes=[64, 128])
    assert (summary.measured, summary.skipped, summary.total) == (3, 2, 5)
    records = CostDataset.open(out).load()
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert r["total_s"] > 0 and r["batch_size"] == (64, 128)[r["index"] % 2]
        assert 1 <= len(r["tables"]) <= 15
        assert r["extra"]["allocator_mitigated"] is True
        assert r["extra"]["reference_s"] > 0  # the machine's speed beside the sample
        # augmented widths of the given tables (NeuroShard's {4..128})
        assert all(t["dim"] in (4, 8, 16, 32, 64, 128) for t in r["tables"])


def test_other_settings_are_refused(tmp_path: Path) -> None:
    profile_compute(TABLES, tmp_path / "c", 1, batch_sizes=[64])
    with pytest.raises(UserError):
        profile_compute(TABLES, tmp_path / "c", 2, batch_sizes=[128])


@pytest.mark.slow
def test_comm_samples(tmp_path: Path) -> None:
    summary = profile_comm(tmp_path / "comm", 3, world_sizes=[2], batch_size=64)
    assert summary.total == 3
    for r in CostDataset.open(tmp_path / "comm").load():
        assert r["world_size"] == 2 and len(r["fwd_s"]) == 2
        assert all(x > 0 for x in r["fwd_s"] + r["bwd_s"])


def test_allow_mismatch_records_carry_this_machines_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that appends despite another fingerprint stamps its own key on its records,
    not the dataset creator's (the manifest lists both)."""
    import shardwise.profiler.collect as collect

    here = current_fingerprint()
    elsewhere = dataclasses.replace(here, device="cpu:Another CPU", cores=here.cores + 8)
    with monkeypatch.context() as m:
        m.setattr(collect, "current_fingerprint", lambda device=None: elsewhere)
        profile_compute(TABLES, tmp_path / "c", 1, batch_sizes=[64])
    profile_compute(TABLES, tmp_path / "c", 2, batch_sizes=[64], allow_mismatch=True)
    ds = CostDataset.open(tmp_path / "c")
    assert [r["fingerprint"] for r in ds.load()] == [elsewhere.key(), here.key()]
    assert set(ds.manifest.fingerprints) == {elsewhere.key(), here.key()}


def test_repair_rebuilds_a_lost_manifest_from_the_records(tmp_path: Path) -> None:
    out = tmp_path / "c"
    profile_compute(TABLES, out, 3, batch_sizes=[64, 128], seed=4)
    before = CostDataset.open(out).dataset_hash()
    (out / MANIFEST_FILE).unlink()
    with pytest.raises(UserError, match="--repair"):
        profile_compute(TABLES, out, 3, batch_sizes=[64, 128], seed=4)
    with pytest.raises(UserError, match=r"line 1 \(sample 0\): tables .* these options draw"):
        profile_compute(TABLES, out, 3, batch_sizes=[64, 128], seed=5, repair=True)
    with pytest.raises(UserError, match=r"line 2 \(sample 1\): batch 128, these options give 64"):
        profile_compute(TABLES, out, 3, batch_sizes=[64], seed=4, repair=True)
    assert not (out / MANIFEST_FILE).exists()

    summary = profile_compute(TABLES, out, 3, batch_sizes=[64, 128], seed=4, repair=True)
    assert (summary.repaired, summary.measured, summary.total) == (3, 0, 3)
    assert CostDataset.open(out).dataset_hash() == before


def test_repair_checks_comm_records_against_the_tasks() -> None:
    from shardwise.profiler.collect import _comm_check
    from shardwise.profiler.dataset.store import CommRecord
    from shardwise.profiler.sampling import comm_task

    task = comm_task(0, 3, [2, 4])
    w = task.world_size
    rec = CommRecord(
        index=3,
        fingerprint="k",
        batch_size=128,
        world_size=w,
        dims=task.dims,
        delays_s=task.delays,
        fwd_s=[0.001] * w,
        bwd_s=[0.001] * w,
        fwd_cv=[0.0] * w,
        bwd_cv=[0.0] * w,
        repeats=10,
    )
    assert _comm_check(0, [2, 4], 128)(rec) is None
    assert "these options give 64 (--batch-per-rank)" in str(_comm_check(0, [2, 4], 64)(rec))
    other = next(s for s in range(1, 50) if comm_task(s, 3, [2, 4]).dims != task.dims)
    assert "(--seed, --world-size)" in str(_comm_check(other, [2, 4], 128)(rec))
