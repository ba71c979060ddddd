"""The profiling loops: real measurements appended one by one, resumable after Ctrl-C."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_tables

from shardwise.basics import UserError
from shardwise.profiler.collect import profile_comm, profile_compute
from shardwise.profiler.dataset import CostDataset

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
