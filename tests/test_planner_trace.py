"""Trace files (docs/design.md §4 layout): round trips, measured specs, and clear errors."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.basics import UserError
from shardwise.planner.access import NUM_BINS
from shardwise.planner.synthetic import draw_params, generate_tables, generate_trace
from shardwise.planner.trace import (
    Trace,
    load_trace,
    save_trace,
    specs_from_trace,
    trace_from_streams,
    trace_stats,
)


def tiny(lengths: list[list[int]], indices: list[int]) -> Trace:
    """A hand-made trace; offsets follow from the lengths."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens.reshape(-1), 0)])
    return Trace(torch.tensor(indices, dtype=torch.int64), offsets, lens)


def hist(*pairs: tuple[int, float]) -> tuple[float, ...]:
    h = [0.0] * NUM_BINS
    for k, v in pairs:
        h[k] = v
    return tuple(h)


def write_raw(path: Path, obj: object) -> Path:
    with gzip.open(path, "wb") as f:
        torch.save(obj, f)  # type: ignore[arg-type]
    return path


# --------------------------------------------------------------------------- known answers


def test_indices_1_1_2() -> None:
    # one table, two samples: [1, 1] and [2]
    trace = tiny([[2, 1]], [1, 1, 2])
    trace.check()
    (spec,) = specs_from_trace(trace)
    assert spec.rows == 3  # max index + 1
    assert spec.pooling_factor == 1.5
    assert spec.access_hist == hist((0, 0.5), (1, 0.5))  # row 2 once, row 1 twice


def test_zero_length_samples_count_in_the_pooling_factor() -> None:
    trace = tiny([[0, 3, 0, 1], [1, 1, 1, 1]], [5, 5, 5, 7, 0, 0, 0, 9])
    a, b = specs_from_trace(trace, names=["a", "b"], dims=[8, 16], rows=[10, 10])
    assert (a.pooling_factor, b.pooling_factor) == (1.0, 1.0)
    assert a.access_hist == hist((0, 0.5), (2, 0.5))  # 7 once, 5 three times
    assert b.access_hist == hist((0, 0.5), (2, 0.5))
    assert (a.name, a.dim, a.rows, b.dim) == ("a", 8, 10, 16)


def test_table_never_read() -> None:
    trace = tiny([[0, 0], [1, 0]], [4])
    empty, read = specs_from_trace(trace)
    assert empty.rows == 1 and empty.pooling_factor == 0 and sum(empty.access_hist) == 0
    assert read.rows == 5 and read.access_hist == hist((0, 1.0))


def test_table_views() -> None:
    trace = tiny([[2, 1], [0, 2]], [1, 1, 2, 7, 8])
    assert trace.num_tables == 2 and trace.batch_size == 2
    assert trace.table_indices(0).tolist() == [1, 1, 2]
    assert trace.table_indices(1).tolist() == [7, 8]


def test_trace_stats_known_answer() -> None:
    trace = tiny([[2, 1], [1, 1]], [1, 1, 2, 3, 3])
    stats = trace_stats(trace)
    assert stats["num_indices"] == 5 and stats["num_unique"] == 3
    assert stats["avg_reuse"] == pytest.approx(5 / 3)
    assert stats["unique_row_access_hist"][:2] == pytest.approx([1 / 3, 2 / 3])
    assert stats["index_mass_by_reuse_hist"][:2] == pytest.approx([1 / 5, 4 / 5])


def test_bad_arguments_to_specs_from_trace() -> None:
    trace = tiny([[2, 1]], [1, 1, 2])
    with pytest.raises(UserError, match="index 2 is out of range for 2 rows"):
        specs_from_trace(trace, rows=[2])
    with pytest.raises(UserError, match="2 names given for a trace of 1 tables"):
        specs_from_trace(trace, names=["a", "b"])
    with pytest.raises(UserError, match="multiple of 4"):
        specs_from_trace(trace, dims=6)


# --------------------------------------------------------------------------- files


def test_round_trip(tmp_path: Path) -> None:
    params = draw_params(5, seed=3)
    trace = generate_trace(params, batch_size=256, seed=3)
    path = tmp_path / "sub" / "trace.pt.gz"
    save_trace(trace, path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = load_trace(path)
    for key in ("indices", "offsets", "lengths"):
        assert torch.equal(getattr(back, key), getattr(trace, key))
    assert back.lengths.shape == (5, 256) and back.offsets.numel() == 5 * 256 + 1


def test_tuple_and_plain_torch_files_are_read(tmp_path: Path) -> None:
    """Meta's dataset files hold a plain (not gzip'd) tuple (indices, offsets, lengths)."""
    trace = tiny([[2, 1]], [1, 1, 2])
    plain = tmp_path / "plain.pt"
    torch.save((trace.indices, trace.offsets, trace.lengths.to(torch.int32)), plain)
    back = load_trace(plain)
    assert back.lengths.dtype == torch.int64 and back.indices.tolist() == [1, 1, 2]


def test_specs_from_a_generated_trace_match_the_generator(tmp_path: Path) -> None:
    """The generator measures its specs the way from-trace does: identical results."""
    count, seed, batch = 12, 5, 2048
    params = draw_params(count, seed)
    save_trace(generate_trace(params, batch, seed), tmp_path / "t.pt.gz")
    trace = load_trace(tmp_path / "t.pt.gz")
    from_trace = specs_from_trace(
        trace,
        names=[p.name for p in params],
        dims=[p.dim for p in params],
        rows=[p.rows for p in params],
    )
    assert from_trace == generate_tables(count, seed, batch_size=batch)
    for spec, p in zip(from_trace, params, strict=True):
        # the measured pooling factor is a sample mean over 2048 samples of the drawn one
        assert spec.pooling_factor == pytest.approx(p.pooling_factor, rel=0.15, abs=0.02)


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such trace file"):
        load_trace(tmp_path / "nope.pt.gz")


def test_not_gzip(tmp_path: Path) -> None:
    path = tmp_path / "t.pt.gz"
    path.write_text("indices,offsets\n1,2\n")
    with pytest.raises(UserError, match=r"t\.pt\.gz: not a gzip file"):
        load_trace(path)


def test_truncated_gzip(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "t.pt.gz", {"indices": torch.arange(1000)})
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match="damaged or truncated gzip"):
        load_trace(path)


def test_gzip_but_not_torch(tmp_path: Path) -> None:
    path = tmp_path / "t.pt.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"hello")
    with pytest.raises(UserError, match="not a torch file"):
        load_trace(path)


def test_missing_key(tmp_path: Path) -> None:
    t = tiny([[2, 1]], [1, 1, 2])
    path = write_raw(tmp_path / "t.pt.gz", {"indices": t.indices, "offsets": t.offsets})
    with pytest.raises(UserError, match="lacks 'lengths'"):
        load_trace(path)


def test_not_a_dict(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "t.pt.gz", [torch.zeros(3)])
    with pytest.raises(UserError, match="holds a list"):
        load_trace(path)


MALFORMED = [
    (
        lambda d: d.update(offsets=d["offsets"][:-1]),
        r"'offsets' has 6 entries .* needs T·B \+ 1 = 7",
    ),
    (
        lambda d: d.update(offsets=torch.tensor([0, 2, 1, 3, 3, 4, 5])),
        r"decreases at position 2 \(table 0, sample 1\)",
    ),
    (
        lambda d: d.update(lengths=torch.tensor([[2, 1, 0], [1, 0, 0]])),
        r"lengths\[1, 0\] is 1 but the offsets give 0",
    ),
    (
        lambda d: d.update(indices=torch.tensor([1, 1, 2, -4, 0])),
        r"index #3 \(table 1\) is -4",
    ),
    (lambda d: d.update(lengths=d["lengths"].reshape(-1)), r"must be \[tables, batch size\]"),
    (lambda d: d.update(indices=d["indices"].float()), "must be integers"),
    (lambda d: d.update(offsets=d["offsets"] + 1), "starts at 1, not 0"),
    (lambda d: d.update(indices=d["indices"][:-1]), "ends at 5 but there are 4 indices"),
]


@pytest.mark.parametrize(("mutate", "message"), MALFORMED)
def test_malformed_traces(tmp_path: Path, mutate: object, message: str) -> None:
    t = tiny([[2, 1, 0], [0, 1, 1]], [1, 1, 2, 3, 4])
    data = {"indices": t.indices, "offsets": t.offsets, "lengths": t.lengths}
    mutate(data)  # type: ignore[operator]
    path = write_raw(tmp_path / "bad.pt.gz", data)
    with pytest.raises(UserError, match=message) as err:
        load_trace(path)
    assert "bad.pt.gz" in str(err.value)


def test_trace_from_streams() -> None:
    lengths = [np.array([1, 0, 2]), np.array([0, 0, 1])]
    indices = [np.array([4, 5, 6]), np.array([9])]
    trace = trace_from_streams(lengths, indices)
    trace.check()
    assert trace.offsets.tolist() == [0, 1, 1, 3, 3, 3, 4]
    assert trace.table_indices(1).tolist() == [9]
