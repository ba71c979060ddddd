"""Table specs and their files: round trips, and errors that name file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import (
    NO_REUSE_HIST,
    TableSpec,
    dump_tables,
    load_tables,
    parse_tables,
    save_tables,
)


@st.composite
def histograms(draw: st.DrawFn) -> tuple[float, ...]:
    weights = draw(st.lists(st.integers(0, 1000), min_size=NUM_BINS, max_size=NUM_BINS))
    total = sum(weights)
    if total == 0:
        return NO_REUSE_HIST
    return tuple(w / total for w in weights)


specs = st.builds(
    TableSpec,
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,20}", fullmatch=True),
    rows=st.integers(1, 10**9),
    dim=st.integers(1, 256).map(lambda d: 4 * d),
    pooling_factor=st.floats(0, 500, allow_nan=False),
    access_hist=histograms(),
    dtype=st.sampled_from(["fp32", "fp16"]),
)
unique_specs = st.lists(specs, min_size=1, max_size=8, unique_by=lambda t: t.name)


@settings(max_examples=60, deadline=None)
@given(tables=unique_specs, fmt=st.sampled_from(["yaml", "json", "csv"]))
def test_round_trip_every_format(tables: list[TableSpec], fmt: str) -> None:
    assert parse_tables(dump_tables(tables, fmt), fmt) == tables


@settings(max_examples=60, deadline=None)
@given(
    dim=st.integers(-10, 600).filter(lambda d: d <= 0 or d % 4),
    fmt=st.sampled_from(["yaml", "csv"]),
)
def test_bad_dim_is_named(dim: int, fmt: str) -> None:
    good = TableSpec(name="ok", rows=10, dim=8, pooling_factor=1.0)
    text = dump_tables([good], fmt).replace("dim: 8", f"dim: {dim}")
    if fmt == "csv":
        text = text.replace("ok,10,8,", f"ok,10,{dim},")
    with pytest.raises(UserError) as info:
        parse_tables(text, fmt, "t.src")
    assert "field 'dim'" in str(info.value)
    assert "line 2" in str(info.value)


def test_yaml_error_names_file_line_table_and_field(tmp_path: Path) -> None:
    path = tmp_path / "tables.yaml"
    path.write_text(
        "tables:\n"
        "  - {name: a, rows: 100, dim: 16, pooling_factor: 2}\n"
        "  - name: t17\n"
        "    rows: 100\n"
        "    dim: 18\n"
        "    pooling_factor: 2\n"
    )
    with pytest.raises(UserError) as info:
        load_tables(path)
    msg = str(info.value)
    assert f"{path}, line 3: table 't17', field 'dim'" in msg
    assert "multiple of 4" in msg and "use 20" in msg


def test_json_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "tables.json"
    path.write_text(
        '{"tables": [\n {"name": "a", "rows": 1, "dim": 4, "pooling_factor": 1},\n'
        ' {"name": "b", "rows": 0, "dim": 4, "pooling_factor": 1}\n]}\n'
    )
    with pytest.raises(UserError, match=r"line 3: table 'b', field 'rows'"):
        load_tables(path)


def test_syntax_errors_have_lines(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "t.yaml"
    bad_yaml.write_text("tables:\n  - name: a\n   rows: [\n")
    with pytest.raises(UserError, match=r"t.yaml, line \d+: not valid YAML"):
        load_tables(bad_yaml)
    bad_json = tmp_path / "t.json"
    bad_json.write_text('{"tables": [\n  {"name": "a",}\n]}')
    with pytest.raises(UserError, match=r"t.json, line 2: not valid JSON"):
        load_tables(bad_json)


def test_csv_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("name,rows\na,10\n")
    with pytest.raises(UserError, match="line 1: the CSV header lacks dim, pooling_factor"):
        load_tables(path)
    path.write_text("name,rows,dim,pooling_factor\na,10,16,1\nb,ten,16,1\n")
    with pytest.raises(UserError, match="line 3: table 'b', field 'rows'"):
        load_tables(path)


def test_duplicates_unknown_fields_and_empty(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="'a' repeats"):
        parse_tables(
            "- {name: a, rows: 1, dim: 4, pooling_factor: 1}\n"
            "- {name: a, rows: 1, dim: 4, pooling_factor: 1}\n",
            "yaml",
        )
    with pytest.raises(UserError, match="field 'colour'"):
        parse_tables("- {name: a, rows: 1, dim: 4, pooling_factor: 1, colour: red}\n", "yaml")
    with pytest.raises(UserError, match="holds no tables"):
        parse_tables("tables: []\n", "yaml")
    with pytest.raises(UserError, match="expected a list of tables"):
        parse_tables("name: a\n", "yaml")


def test_histogram_rules() -> None:
    with pytest.raises(ValueError, match="17 bins"):
        TableSpec(name="a", rows=1, dim=4, pooling_factor=1, access_hist=(1.0,))
    with pytest.raises(ValueError, match="sum to 1"):
        TableSpec(name="a", rows=1, dim=4, pooling_factor=1, access_hist=(0.5,) * NUM_BINS)


def test_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such tables file"):
        load_tables(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="name the file .yaml"):
        load_tables(tmp_path / "tables.txt")
    tables = [TableSpec(name="a", rows=10, dim=8, pooling_factor=1.5, dtype="fp16")]
    save_tables(tables, tmp_path / "deep" / "t.yml")
    assert load_tables(tmp_path / "deep" / "t.yml") == tables
    assert tables[0].size_bytes == 10 * 8 * 2
