"""Embedding-table specs (docs/design.md §4) and their files: YAML, JSON and CSV.

A spec is what every planner and cost model sees of a table: its size (``rows``,
``dim``, ``dtype``), how often it is read (``pooling_factor``) and its locality
(``access_hist``, 17 bins, see :mod:`shardwise.planner.access`). Files are read with
errors that name the file, the line, the table and the field. :func:`table_signature`
names what a kernel's cost depends on, so a calibrated cost model can say which tables
it covers (docs/model-cache.md).

What a file may hold is bounded (``MAX_ROWS``, ``MAX_DIM``, ``MAX_POOLING_FACTOR``):
whatever path builds a spec (a file, a DLRMJob, the generator, a trace) goes through
:class:`TableSpec`, so no later step meets a table it cannot allocate. A file that
YAML, JSON or CSV cannot read, or that PyYAML would read differently than it looks
(a key written twice, ``1e12`` as text, ``true`` as a count), is a
:class:`~shardwise.basics.UserError`, never another exception.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from shardwise.basics import UserError, read_text
from shardwise.planner.access import NUM_BINS

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2}
#: Used when a file gives no histogram: every accessed row is read once per batch.
NO_REUSE_HIST: tuple[float, ...] = (1.0,) + (0.0,) * (NUM_BINS - 1)
#: A histogram whose sum is this close to 1 is kept as written (rounding noise).
_HIST_TOLERANCE = 1e-3
#: Hand-written fractions rarely add up exactly (0.99 after rounding each bin): a sum
#: within 2% of 1 is scaled to 1; further off, a bin is wrong and the file is refused.
HIST_SCALE_TOLERANCE = 0.02
#: Bounds a kernel can take (the DLRMJob CRD states the same ones, with the same reasons).
#: 2^40 rows take 8 TiB even at the narrowest width (4 columns of fp16): beyond any
#: cluster's GPU memory, so a larger hash size is a mistake.
MAX_ROWS = 2**40
#: FBGEMM's GPU training kernels are generated for embedding widths up to 2048.
MAX_DIM = 2048
#: At 65,536 samples per GPU on 8 GPUs, 1024 lookups per sample are 4 GiB of indices
#: per table and iteration; Meta's open DLRM dataset averages about 16.
MAX_POOLING_FACTOR = 1024.0
#: A number written with an exponent, which YAML 1.1 reads as text unless it has a dot
#: and a signed exponent (``1.0e+12``), and which an integer field cannot parse.
_EXPONENT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+")
_CSV_HIST = [f"h{k}" for k in range(NUM_BINS)]
CSV_COLUMNS = ["name", "rows", "dim", "pooling_factor", "dtype", *_CSV_HIST]


def _exponent_hint(field: str, text: str) -> str:
    """What to write instead of ``1e12`` in an integer field."""
    number = float(text.replace("_", ""))
    if not math.isfinite(number) or abs(number) > 2**64:
        bound = f"{MAX_ROWS} (2^40)" if field == "rows" else str(MAX_DIM)
        return f"{field} {text!r} is far too large; {field} is at most {bound}"
    if not number.is_integer():
        return f"{field} {text!r} is not a whole number; {field} must be one"
    mantissa, exponent = re.split("[eE]", text.replace("_", ""))
    mantissa += "" if "." in mantissa else ".0"
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    return (
        f"{field} {text!r} is text, not a number: YAML 1.1 reads a number with an exponent "
        f"only with a dot and a signed exponent, and {field} is a whole number; write "
        f"{int(number)} (or {mantissa}e{exponent} in YAML)"
    )


class TableSpec(BaseModel):
    """One embedding table as the planner sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")
    rows: int = Field(gt=0, description="hash size (number of embedding rows)")
    dim: int = Field(gt=0, description="embedding width; a multiple of 4")
    pooling_factor: float = Field(ge=0, description="mean lookups per sample")
    access_hist: tuple[float, ...] = Field(default=NO_REUSE_HIST)
    dtype: Literal["fp32", "fp16"] = "fp32"

    @field_validator("rows", "dim", "pooling_factor", mode="before")
    @classmethod
    def _a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse what pydantic would coerce silently: ``true`` (YAML's yes/on too) as 1,
        and say how to write ``1e12``, which YAML 1.1 leaves as text."""
        field = info.field_name or "value"
        if isinstance(value, bool):
            raise ValueError(
                f"{field} is {str(value).lower()}, a boolean, not a number (YAML reads "
                "true/false/yes/no/on/off as booleans); write a number"
            )
        if field != "pooling_factor" and isinstance(value, str) and _EXPONENT.fullmatch(value):
            raise ValueError(_exponent_hint(field, value))
        return value

    @field_validator("access_hist", mode="before")
    @classmethod
    def _fractions(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            flags = [k for k, x in enumerate(value) if isinstance(x, bool)]
            if flags:
                raise ValueError(
                    f"access_hist bin {flags[0]} is a boolean, not a fraction; write a number"
                )
        return value

    @field_validator("rows")
    @classmethod
    def _rows_bound(cls, rows: int) -> int:
        if rows > MAX_ROWS:
            raise ValueError(
                f"rows {rows} is above {MAX_ROWS} (2^40): that many rows take 8 TiB even "
                "at 4 columns of fp16, more than any cluster's GPUs hold"
            )
        return rows

    @field_validator("dim")
    @classmethod
    def _dim_multiple_of_4(cls, dim: int) -> int:
        if dim > MAX_DIM:
            raise ValueError(
                f"dim {dim} is above {MAX_DIM}, the widest embedding FBGEMM's GPU kernels "
                "are built for; split the table into narrower ones"
            )
        if dim % 4:
            raise ValueError(
                f"dim {dim} is not a multiple of 4 (FBGEMM kernels and column-wise "
                f"shards need it); use {dim + 4 - dim % 4}"
            )
        return dim

    @field_validator("pooling_factor")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("pooling_factor must be a finite number")
        if value > MAX_POOLING_FACTOR:
            raise ValueError(
                f"pooling_factor {value:g} is above {MAX_POOLING_FACTOR:g} lookups per "
                "sample: at 65,536 samples per GPU on 8 GPUs that is 4 GiB of indices per "
                "table and iteration, almost surely a mistake"
            )
        return value

    @field_validator("access_hist")
    @classmethod
    def _histogram(cls, hist: tuple[float, ...]) -> tuple[float, ...]:
        if len(hist) != NUM_BINS:
            raise ValueError(f"access_hist needs {NUM_BINS} bins, got {len(hist)}")
        if any(not math.isfinite(x) or x < 0 for x in hist):
            raise ValueError("access_hist fractions must be finite and >= 0")
        total = math.fsum(hist)
        if not total or abs(total - 1.0) <= _HIST_TOLERANCE:
            return hist
        if abs(total - 1.0) <= HIST_SCALE_TOLERANCE:
            return tuple(x / total for x in hist)
        raise ValueError(
            f"access_hist must sum to 1 (within {HIST_SCALE_TOLERANCE:.0%}, then it is "
            f"scaled to 1), but it sums to {total:.4f}; correct the bin that is off, or "
            f"divide every bin by {total:.4g}"
        )

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def size_bytes(self) -> int:
        """Weights only: rows × dim × bytes per element (docs/design.md §4)."""
        return self.rows * self.dim * self.bytes_per_element

    def column_bytes(self, cols: int) -> int:
        """Memory of a column-wise shard ``cols`` wide."""
        return self.rows * cols * self.bytes_per_element


# --------------------------------------------------------------------------- loading


def _describe(err: ValidationError, where: str, name: str | None) -> str:
    lines = []
    who = f"table {name!r}" if name else "a table"
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(the entry)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {who}, field {field!r}: {msg}")
    return "\n".join(lines)


def _validate_entries(entries: Sequence[Any], where: Sequence[str], source: str) -> list[TableSpec]:
    specs: list[TableSpec] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for entry, loc in zip(entries, where, strict=True):
        if not isinstance(entry, dict):
            problems.append(f"{loc}: each table must be a mapping with name, rows, dim, …")
            continue
        name = entry.get("name") if isinstance(entry.get("name"), str) else None
        try:
            spec = TableSpec.model_validate(entry)
        except ValidationError as err:
            problems.append(_describe(err, loc, name))
            continue
        if spec.name in seen:
            problems.append(f"{loc}: table name {spec.name!r} repeats (first at {seen[spec.name]})")
            continue
        seen[spec.name] = loc
        specs.append(spec)
    if problems:
        shown = problems[:20]
        more = f"\n… and {len(problems) - 20} more problems" if len(problems) > 20 else ""
        raise UserError(
            f"{source} has invalid tables:\n" + "\n".join(shown) + more + "\n"
            f"Each table needs name, rows (1 to 2^40), dim (4 to {MAX_DIM}, a multiple of 4), "
            f"pooling_factor (0 to {MAX_POOLING_FACTOR:g}), optionally dtype (fp32|fp16) and "
            f"access_hist ({NUM_BINS} fractions summing to 1)."
        )
    if not specs:
        raise UserError(f"{source} holds no tables.")
    return specs


class _DuplicateKey(yaml.YAMLError):
    """A key written twice in one mapping; PyYAML and ``json`` would keep the last."""

    def __init__(self, key: Any, first: int | None, second: int | None) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.second = key, first, second

    def describe(self, source: str) -> str:
        where = f"{source}, line {self.second}" if self.second else source
        first = f" (first on line {self.first})" if self.first else ""
        return (
            f"{where}: the key {self.key!r} is given twice in one mapping{first}; "
            "a parser would silently keep the last. Remove one of them."
        )


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (:class:`_DuplicateKey`)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # merge keys (<<) may override; complex keys fail as unhashable
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: a key twice is a :class:`_DuplicateKey` (no lines)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key, None, None)
        obj[key] = value
    return obj


def _json_duplicate(text: str, err: _DuplicateKey) -> _DuplicateKey:
    """The same duplicate with its lines, found by reading the JSON as YAML."""
    try:
        yaml.load(text, Loader=_Loader)
    except _DuplicateKey as located:
        return located
    except (yaml.YAMLError, ValueError, RecursionError):
        pass
    return err


def _entry_lines(text: str) -> list[int] | None:
    """1-based line of each table entry, found by composing the YAML (JSON is YAML)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return None
    if isinstance(node, yaml.MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "tables"), None)
    if not isinstance(node, yaml.SequenceNode):
        return None
    return [item.start_mark.line + 1 for item in node.value]


def _table_list(doc: Any, source: str) -> list[Any]:
    if isinstance(doc, dict) and "tables" in doc:
        doc = doc["tables"]
    if not isinstance(doc, list):
        raise UserError(
            f"{source}: expected a list of tables, or a mapping with a 'tables' list, "
            f"found {type(doc).__name__}."
        )
    return doc


def _load_structured(text: str, source: str, fmt: str) -> Any:
    """The document, or a :class:`UserError` for anything its parser refuses."""
    kind = fmt.upper()
    try:
        if fmt == "json":
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as err:
        located = _json_duplicate(text, err) if fmt == "json" else err
        raise UserError(located.describe(source)) from None
    except json.JSONDecodeError as err:
        raise UserError(f"{source}, line {err.lineno}: not valid JSON: {err.msg}.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"{source}{line}: not valid YAML: {problem}.") from None
    except RecursionError:
        raise UserError(
            f"{source}: nested too deeply for the {kind} parser; a tables file is a list of "
            "flat mappings (or a mapping with a 'tables' list)."
        ) from None
    except ValueError as err:  # Python's limit on the digits of an integer, for one
        if "digits" in str(err):
            raise UserError(
                f"{source}: a number has thousands of digits; no field takes one that long "
                f"(rows is at most 2^40 = {MAX_ROWS})."
            ) from None
        raise UserError(f"{source}: cannot read it as {kind}: {err}.") from None


def _parse_structured(text: str, source: str, fmt: str) -> list[TableSpec]:
    doc = _load_structured(text, source, fmt)
    entries = _table_list(doc, source)
    lines = _entry_lines(text)
    if lines is None or len(lines) != len(entries):
        where = [f"{source}, table #{i + 1}" for i in range(len(entries))]
    else:
        where = [f"{source}, line {n}" for n in lines]
    return _validate_entries(entries, where, source)


def _csv_header(reader: Any, source: str) -> list[str]:
    try:
        header = list(reader.fieldnames or [])
    except csv.Error as err:
        raise UserError(f"{source}, line 1: not valid CSV: {err}.") from None
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise UserError(
            f"{source}, line 1: the CSV header names {', '.join(map(repr, repeated))} more "
            "than once; a reader would silently keep the last column. Remove the repeats."
        )
    missing = [c for c in ("name", "rows", "dim", "pooling_factor") if c not in header]
    if missing:
        raise UserError(
            f"{source}, line 1: the CSV header lacks {', '.join(missing)}. "
            f"Expected columns: {', '.join(CSV_COLUMNS)} (dtype and h0…h16 optional)."
        )
    return header


def _parse_csv(text: str, source: str) -> list[TableSpec]:
    reader = csv.DictReader(io.StringIO(text))
    _csv_header(reader, source)
    entries: list[dict[str, Any]] = []
    where: list[str] = []
    try:
        for row in reader:
            entry: dict[str, Any] = {
                k: v for k, v in row.items() if k in ("name", "rows", "dim", "pooling_factor")
            }
            if row.get("dtype"):
                entry["dtype"] = row["dtype"]
            hist = [row.get(c) for c in _CSV_HIST]
            if any(h not in (None, "") for h in hist):
                entry["access_hist"] = [h if h not in (None, "") else "missing" for h in hist]
            if None in row:
                entry["extra columns"] = row[None]
            entries.append(entry)
            where.append(f"{source}, line {reader.line_num}")
    except csv.Error as err:
        raise UserError(f"{source}, line {reader.line_num}: not valid CSV: {err}.") from None
    return _validate_entries(entries, where, source)


def parse_tables(text: str, fmt: str, source: str = "<tables>") -> list[TableSpec]:
    """Parse table specs from text in ``fmt`` (yaml, json or csv)."""
    if fmt == "csv":
        return _parse_csv(text, source)
    if fmt in ("yaml", "json"):
        return _parse_structured(text, source, fmt)
    raise UserError(f"{source}: unknown tables format {fmt!r}; use yaml, json or csv.")


def format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix in (".json", ".csv"):
        return suffix[1:]
    raise UserError(
        f"{path}: cannot tell the format from the extension {suffix!r}; "
        "name the file .yaml, .yml, .json or .csv."
    )


def load_tables(path: str | Path) -> list[TableSpec]:
    """Read a tables file; every problem is a :class:`UserError` naming file and line."""
    p = Path(path)
    fmt = format_of(p)
    return parse_tables(read_text(p, "tables"), fmt, str(p))


def dump_tables(tables: Iterable[TableSpec], fmt: str) -> str:
    """Serialize specs to yaml, json or csv text that :func:`parse_tables` reads back."""
    records = [t.model_dump(mode="json") for t in tables]
    if fmt == "json":
        return json.dumps({"tables": records}, indent=1) + "\n"
    if fmt == "yaml":
        return yaml.safe_dump({"tables": records}, sort_keys=False, default_flow_style=None)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for r in records:
            hist = r.pop("access_hist")
            writer.writerow({**r, **{c: repr(x) for c, x in zip(_CSV_HIST, hist, strict=True)}})
        return out.getvalue()
    raise UserError(f"unknown tables format {fmt!r}; use yaml, json or csv.")


def save_tables(tables: Iterable[TableSpec], path: str | Path) -> None:
    p = Path(path)
    text = dump_tables(tables, format_of(p))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------- signatures
#: Bump when what a signature covers changes: old calibrations then cover nothing.
SIGNATURE_VERSION = 1


def table_signature(spec: TableSpec) -> str:
    """A short stable id (16 hex digits) of what a table's kernel cost depends on.

    Rows, width, dtype, pooling factor (4 significant digits) and the access
    histogram (each bin to 4 decimals); not the name, so a renamed table keeps its
    calibration and two tables alike share one. Torch-free: the operator uses it.
    """
    blob = "|".join(
        (
            f"v{SIGNATURE_VERSION}",
            str(spec.rows),
            str(spec.dim),
            spec.dtype,
            f"{spec.pooling_factor:.4g}",
            ",".join(f"{x:.4f}" for x in spec.access_hist),
        )
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tables_signatures(tables: Iterable[TableSpec]) -> list[str]:
    """The signatures of ``tables``, sorted and unique (a calibration's covered set)."""
    return sorted({table_signature(t) for t in tables})
