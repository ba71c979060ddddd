"""Table specs and their files: round trips, and errors that name file, line and field."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardwise.basics import UserError
from shardwise.planner.access import NUM_BINS
from shardwise.planner.tables import (
    CSV_COLUMNS,
    MAX_DIM,
    MAX_POOLING_FACTOR,
    MAX_ROWS,
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


# --------------------------------------------------------------------------- what a file
# says is what it means: the documented example, booleans, duplicate keys, 1e12, bounds


def test_documented_tables_example_loads(tmp_path: Path) -> None:
    """The example in docs/cli.md is a valid file, its histogram summing to 1."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    block = page.split("Tables files are YAML, JSON or CSV:", 1)[1]
    text = block.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "tables.yaml"
    path.write_text(text)
    (spec,) = load_tables(path)
    assert spec.name == "user_id" and spec.dtype == "fp16"
    assert sum(spec.access_hist) == pytest.approx(1.0, abs=1e-12)


def test_histogram_within_two_percent_is_scaled() -> None:
    """Rounded hand-written fractions (sum 0.99, the README's old example) are scaled to
    sum to 1; a sum further off names the sum and how to fix it."""
    written = (0.47, 0.15, 0.14, 0.11, 0.07, 0.03, 0.01, 0.01) + (0.0,) * 9
    spec = TableSpec(name="a", rows=10, dim=4, pooling_factor=1, access_hist=written)
    assert math.fsum(spec.access_hist) == pytest.approx(1.0, abs=1e-12)
    assert spec.access_hist[0] == pytest.approx(0.47 / 0.99)
    near = (0.5004, 0.5) + (0.0,) * 15  # within 1e-3: kept as written (plans hash it)
    assert (
        TableSpec(name="a", rows=1, dim=4, pooling_factor=1, access_hist=near).access_hist == near
    )
    with pytest.raises(UserError) as info:
        parse_tables(
            "- {name: a, rows: 1, dim: 4, pooling_factor: 1, access_hist: "
            "[0.5, 0.4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]}\n",
            "yaml",
            "t.yaml",
        )
    msg = str(info.value)
    assert "t.yaml, line 1: table 'a', field 'access_hist'" in msg
    assert "sums to 0.9000" in msg and "within 2%" in msg and "divide every bin by 0.9" in msg


@pytest.mark.parametrize(
    ("text", "fmt", "field"),
    [
        ("- {name: a, rows: true, dim: 4, pooling_factor: 1}\n", "yaml", "rows"),
        ("- {name: a, rows: yes, dim: 4, pooling_factor: 1}\n", "yaml", "rows"),
        ("- {name: a, rows: 8, dim: on, pooling_factor: 1}\n", "yaml", "dim"),
        ("- {name: a, rows: 8, dim: 4, pooling_factor: false}\n", "yaml", "pooling_factor"),
        ('[{"name": "a", "rows": true, "dim": 4, "pooling_factor": 1}]', "json", "rows"),
        ('[{"name": "a", "rows": 1, "dim": 4, "pooling_factor": true}]', "json", "pooling_factor"),
    ],
)
def test_booleans_are_not_numbers(text: str, fmt: str, field: str) -> None:
    with pytest.raises(UserError) as info:
        parse_tables(text, fmt, f"t.{fmt}")
    msg = str(info.value)
    assert f"t.{fmt}, line 1: table 'a', field '{field}'" in msg and "a boolean" in msg
    hist = "[true" + ", 0" * (NUM_BINS - 1) + "]"
    with pytest.raises(UserError, match="bin 0 is a boolean"):
        parse_tables(
            f"- {{name: a, rows: 1, dim: 4, pooling_factor: 1, access_hist: {hist}}}\n", "yaml"
        )


def test_duplicate_keys_are_refused_with_both_lines() -> None:
    """PyYAML and json keep the last of two equal keys; we refuse, naming both lines."""
    yaml_text = (
        "tables:\n  - name: a\n    rows: 5\n    dim: 4\n    rows: 7\n    pooling_factor: 1\n"
    )
    with pytest.raises(UserError) as info:
        parse_tables(yaml_text, "yaml", "t.yaml")
    assert "t.yaml, line 5: the key 'rows' is given twice in one mapping (first on line 3)" in str(
        info.value
    )
    json_text = (
        '{"tables": [\n {"name": "a", "rows": 5, "dim": 4,\n  "rows": 7, "pooling_factor": 1}]}'
    )
    with pytest.raises(UserError, match=r"t.json, line 3: the key 'rows' .* \(first on line 2\)"):
        parse_tables(json_text, "json", "t.json")
    with pytest.raises(UserError, match="t.yaml, line 2: the key 'tables' is given twice"):
        parse_tables("tables: []\ntables: []\n", "yaml", "t.yaml")
    with pytest.raises(
        UserError, match="t.csv, line 1: the CSV header names 'rows' more than once"
    ):
        parse_tables("name,rows,dim,pooling_factor,rows\na,5,4,1,7\n", "csv", "t.csv")
    # a merge key may still be overridden: that is what it is for
    (spec,) = parse_tables(
        "base: &b {rows: 5, dim: 4, pooling_factor: 1}\ntables:\n  - {<<: *b, name: a, rows: 7}\n",
        "yaml",
    )
    assert spec.rows == 7


def test_exponent_in_an_integer_says_what_to_write() -> None:
    """YAML 1.1 reads ``1e12`` as text: say so and what to write instead."""
    with pytest.raises(UserError) as info:
        parse_tables("- {name: a, rows: 1e12, dim: 4, pooling_factor: 1}\n", "yaml", "t.yaml")
    msg = str(info.value)
    assert "t.yaml, line 1: table 'a', field 'rows': rows '1e12' is text, not a number" in msg
    assert "write 1000000000000 (or 1.0e+12 in YAML)" in msg and "whole number" in msg
    with pytest.raises(UserError, match=r"dim '2\.55e1' is not a whole number"):
        parse_tables("name,rows,dim,pooling_factor\na,10,2.55e1,1\n", "csv", "t.csv")
    for rows in ("1000000000000", "1.0e+12"):
        (spec,) = parse_tables(f"- {{name: a, rows: {rows}, dim: 4, pooling_factor: 1}}\n", "yaml")
        assert spec.rows == 10**12


BOUNDS = [
    ("rows", str(2**40 + 1), "above 1099511627776 (2^40)", "8 TiB"),
    ("dim", "2052", "above 2048", "FBGEMM"),
    ("pooling_factor", "1025", "above 1024 lookups per sample", "4 GiB of indices"),
    ("pooling_factor", "1.0e+300", "above 1024 lookups per sample", "4 GiB of indices"),
]


@pytest.mark.parametrize(("field", "value", "bound", "why"), BOUNDS)
@pytest.mark.parametrize("fmt", ["yaml", "json", "csv"])
def test_bounds_hold_in_every_format(
    field: str, value: str, bound: str, why: str, fmt: str
) -> None:
    entry = {"name": "a", "rows": "10", "dim": "8", "pooling_factor": "1", field: value}
    if fmt == "csv":
        text = "name,rows,dim,pooling_factor\n" + ",".join(entry.values()) + "\n"
        line = 2
    else:
        text = (
            "[{"
            + ", ".join(
                f'"{k}": {v if k != "name" else chr(34) + v + chr(34)}' for k, v in entry.items()
            )
            + "}]"
        )
        line = 1
    with pytest.raises(UserError) as info:
        parse_tables(text, fmt, f"t.{fmt}")
    msg = str(info.value)
    assert f"t.{fmt}, line {line}: table 'a', field '{field}'" in msg
    assert bound in msg and why in msg


def test_bounds_hold_for_traces_and_the_generator() -> None:
    """The trace path (``tables from-trace``) and the generator build specs through
    :class:`TableSpec` too: a measured pooling above the bound is a UserError."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("torch")
    from shardwise.planner.synthetic import generate_tables
    from shardwise.planner.trace import measure_counts, spec_from_measure

    heavy = measure_counts(np.full(8, 2000, dtype=np.int64), batch_size=10)  # 1600 per sample
    with pytest.raises(
        UserError, match="table 't': pooling_factor: pooling_factor 1600 is above 1024"
    ):
        spec_from_measure(heavy, name="t", dim=8)
    light = measure_counts(np.ones(8, dtype=np.int64), batch_size=4)
    with pytest.raises(UserError, match="dim 4096 is above 2048"):
        spec_from_measure(light, name="t", dim=4096)
    for spec in generate_tables(40, seed=3, batch_size=512):
        assert spec.rows <= MAX_ROWS and spec.dim <= MAX_DIM
        assert spec.pooling_factor <= MAX_POOLING_FACTOR


# --------------------------------------------------------------------------- fuzzing: a
# tables file either loads or is a UserError naming the file, never another exception

#: Scalars as people (and typos) write them, spelled raw into YAML, JSON and CSV text.
RAW = [
    "1",
    "0",
    "-3",
    "8",
    "4096",
    "1e12",
    "1.0e+12",
    "1e300",
    "1E6",
    ".inf",
    "-.inf",
    ".nan",
    "NaN",
    "Infinity",
    "true",
    "yes",
    "off",
    "null",
    "~",
    "0x10",
    "010",
    "1:20",
    "1_000",
    "2001-12-14",
    '"8"',
    "'x'",
    "[]",
    "{}",
    "[1, 2]",
    "abc",
    "9" * 30,
    "9" * 5000,
    str(2**40),
    str(2**40 + 1),
    "2048",
    "2052",
    "1024",
    "1024.5",
    "-0.0",
    "!!binary aGk=",
    "*nope",
    "&a 1",
    "\t",
    "",
    "fp16",
    "fp64",
]
FIELDS = ["name", "rows", "dim", "pooling_factor", "dtype", "access_hist", "colour"]


@st.composite
def raw_structured(draw: st.DrawFn) -> tuple[str, str]:
    """A YAML or JSON file of near-valid entries with raw scalars and raw keys."""
    fmt = draw(st.sampled_from(["yaml", "json"]))
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        fields = {"name": '"a"', "rows": "10", "dim": "8", "pooling_factor": "1"}
        for key in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
            fields[key] = draw(st.sampled_from(RAW))
        if draw(st.booleans()):
            hist = draw(st.lists(st.sampled_from([*RAW, "0.5", "0.25"]), min_size=15, max_size=19))
            fields["access_hist"] = "[" + ", ".join(hist) + "]"
        pairs = [f'"{k}": {v}' for k, v in fields.items()]
        if draw(st.booleans()):
            pairs.append(draw(st.sampled_from(pairs)))  # a key twice
        entries.append("{" + ", ".join(pairs) + "}")
    sep = draw(st.sampled_from([",\n ", ", "]))
    body = "[" + sep.join(entries) + "]"
    text = draw(st.sampled_from([body, '{"tables": ' + body + "}", "tables:\n  " + body]))
    return fmt, text


@st.composite
def raw_csv(draw: st.DrawFn) -> tuple[str, str]:
    columns = draw(
        st.lists(st.sampled_from([*CSV_COLUMNS, "colour", "", "rows"]), min_size=0, max_size=24)
    )
    lines = [",".join(columns)]
    for _ in range(draw(st.integers(0, 4))):
        cells = draw(st.lists(st.sampled_from(RAW), min_size=0, max_size=len(columns) + 2))
        lines.append(",".join(cells))
    return "csv", "\n".join(lines) + draw(st.sampled_from(["\n", "", '\n"']))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, str]:
    """A valid file with a slice cut out, random text pasted in, or a line repeated."""
    fmt = draw(st.sampled_from(["yaml", "json", "csv"]))
    good = [TableSpec(name=f"t{i}", rows=10 + i, dim=8, pooling_factor=1.5) for i in range(3)]
    text = dump_tables(good, fmt)
    a = draw(st.integers(0, len(text)))
    b = draw(st.integers(a, min(len(text), a + 40)))
    how = draw(st.sampled_from(["cut", "paste", "repeat"]))
    if how == "cut":
        return fmt, text[:a] + text[b:]
    if how == "paste":
        return fmt, text[:a] + draw(st.text(max_size=12)) + text[b:]
    lines = text.splitlines(keepends=True)
    k = draw(st.integers(0, len(lines) - 1))
    return fmt, "".join(lines[: k + 1] + lines[k:])


any_text = st.tuples(st.sampled_from(["yaml", "json", "csv"]), st.text(max_size=200))
deep = st.tuples(
    st.sampled_from(["yaml", "json"]),
    st.integers(100, 20000).map(lambda n: "[" * n + "]" * n),
)


def _loads_or_names_the_file(fmt: str, text: str) -> None:
    source = f"fuzz/tables.{fmt}"
    try:
        tables = parse_tables(text, fmt, source)
    except UserError as err:
        assert source in str(err)
        return
    assert tables and all(isinstance(t, TableSpec) for t in tables)
    for t in tables:  # what loads keeps the bounds and a histogram that sums to 1 (or 0)
        assert 0 < t.rows <= MAX_ROWS and 0 < t.dim <= MAX_DIM and t.dim % 4 == 0
        assert 0 <= t.pooling_factor <= MAX_POOLING_FACTOR
        assert math.fsum(t.access_hist) in (0.0, pytest.approx(1.0, abs=1e-3))


#: Each crashed the loader once with an exception other than UserError.
CRASHES = [
    ("yaml", "- {name: a, rows: " + "9" * 5000 + ", dim: 4, pooling_factor: 1}\n"),
    ("json", '[{"name": "a", "rows": ' + "9" * 5000 + ', "dim": 4, "pooling_factor": 1}]'),
    ("csv", 'name,rows,dim,pooling_factor\na,"' + "x" * 200_000 + '",4,1\n'),
    ("yaml", "[" * 5000 + "]" * 5000),
]


@settings(max_examples=300, deadline=None)
@given(case=st.one_of(raw_structured(), raw_csv(), mutated(), any_text))
@example(case=CRASHES[0])
@example(case=CRASHES[1])
@example(case=CRASHES[2])
@example(case=CRASHES[3])
@pytest.mark.slow
def test_any_text_loads_or_is_a_user_error(case: tuple[str, str]) -> None:
    _loads_or_names_the_file(*case)


@settings(max_examples=4, deadline=None)
@given(case=deep)
@example(case=("yaml", "[" * 300 + "]" * 300))  # within PyYAML's recursion: parsed
@example(case=("yaml", "[" * 600 + "]" * 600))  # past it: RecursionError
@example(case=("json", "[" * 20000 + "]" * 20000))
@pytest.mark.slow
def test_deep_nesting_is_a_user_error(case: tuple[str, str]) -> None:
    """Either side of the parsers' recursion limit. A YAML file nested past it costs
    PyYAML's scanner seconds (its pending simple keys are checked at every token),
    hence few random depths beside the explicit ones."""
    _loads_or_names_the_file(*case)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=120), suffix=st.sampled_from([".yaml", ".json", ".csv"]))
def test_any_bytes_load_or_are_a_user_error(data: bytes, suffix: str) -> None:
    """Through :func:`load_tables`: bytes that are not UTF-8 included."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"tables{suffix}"
        path.write_bytes(data)
        try:
            assert load_tables(path)
        except UserError as err:
            assert str(path) in str(err)
