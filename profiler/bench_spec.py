"""What a benchmark run measures (docs/design.md §9): its task grid, its table pool, its settings.

A spec is a small YAML or JSON file, or one of the built-in ones (``full``: the
protocol of docs/design.md §9; ``quick``: a CI-sized subset). Errors name the file, the line
and the field, and say what a valid value looks like.

**Held-out tables.** The bundled cost model was trained on the pool
``shardwise tables generate --count 300 --seed 7`` (the Makefile's ``pretrain``
target). The bench draws its tasks from the same generator with another seed
(:data:`DEFAULT_POOL_SEED`), so every table is one the model never saw, from the
distribution it was trained for; the training seed is refused. (The model's own test
split has only 30 tables, too few for 160-table tasks, and ``datasets/`` is not in
the repository.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardwise.basics import UserError, parse_bytes, read_text

#: The seed of the bundled model's training pool (Makefile, ``pretrain``).
TRAINING_POOL_SEED = 7
DEFAULT_POOL_SEED = 11
DEFAULT_POOL_COUNT = 400
#: Tables above this are left out of the pool: the evaluator times each rank with its
#: weights in host memory, so a 160-table task of the generator's 2 GiB tails would
#: hold 15-18 GiB and need minutes of allocation per plan; capping at 512 MiB keeps
#: 95 % of the generated tables (``docs/bench.md``).
DEFAULT_MAX_TABLE_BYTES = 512 * 2**20


class PoolSpec(BaseModel):
    """Where the tasks' tables come from: the generator (seed, count) or a tables file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = DEFAULT_POOL_SEED
    count: int = Field(default=DEFAULT_POOL_COUNT, ge=1, le=100_000)
    max_table_bytes: int = Field(default=DEFAULT_MAX_TABLE_BYTES, gt=0)
    #: A tables file (.yaml/.json/.csv) instead of the generator, relative to the spec.
    file: str | None = None

    @field_validator("max_table_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_bytes(value, "max_table_bytes") if isinstance(value, str) else value

    @field_validator("seed")
    @classmethod
    def _held_out(cls, seed: int) -> int:
        if seed == TRAINING_POOL_SEED:
            raise ValueError(
                f"seed {TRAINING_POOL_SEED} generated the bundled cost model's training "
                f"pool; use another seed (the default is {DEFAULT_POOL_SEED})"
            )
        return seed


class BenchSpec(BaseModel):
    """The task grid: ``tasks`` draws of T tables for W GPUs, for every T and W."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tables: list[int] = Field(min_length=1, description="table counts T")
    gpus: list[int] = Field(min_length=1, description="world sizes W")
    tasks: int = Field(default=3, ge=1, le=1000, description="tasks per (T, W)")
    repeats: int = Field(default=3, ge=1, le=100, description="side-by-side evaluations")
    batch_size_per_rank: int = Field(default=128, ge=1)
    #: Each GPU holds ``memory_factor × max(total / W, largest table)`` of weights.
    memory_factor: float = Field(default=1.3, ge=1.0, le=100.0)
    seed: int = 0
    pool: PoolSpec = PoolSpec()

    @field_validator("tables", "gpus")
    @classmethod
    def _positive_unique(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"every value must be at least 1, got {bad[0]}")
        if len(set(values)) != len(values):
            raise ValueError(f"values repeat: {values}")
        return sorted(values)

    def task_count(self) -> int:
        return len(self.tables) * len(self.gpus) * self.tasks


#: Design §9: T in {10, 20, 40, 80, 160}, W in {2, 4, 8}, three tasks each.
FULL = BenchSpec(tables=[10, 20, 40, 80, 160], gpus=[2, 4, 8], tasks=3)
#: CI-sized: four tasks, the same protocol (measured under 10 minutes, docs/bench.md).
QUICK = BenchSpec(tables=[10, 20], gpus=[2, 4], tasks=1)
BUILTIN: dict[str, BenchSpec] = {"full": FULL, "quick": QUICK}


def _line_of(text: str, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the value at ``loc`` in a YAML/JSON document, if it can be found."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == key), None)
            if match is None:
                return line
            node = match[1]
            line = match[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def parse_spec(text: str, source: str = "<spec>") -> BenchSpec:
    """A spec from YAML or JSON text; every problem is a :class:`UserError` with its line."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        raise UserError(
            f"{source}{line}: not valid YAML or JSON: {getattr(err, 'problem', err)}."
        ) from None
    if not isinstance(doc, dict):
        raise UserError(
            f"{source}: a bench spec is a mapping such as "
            "{tables: [10, 20], gpus: [2, 4], tasks: 1}; found "
            f"{type(doc).__name__}."
        )
    try:
        return BenchSpec.model_validate(doc)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = tuple(e["loc"])
            field = ".".join(str(p) for p in loc) or "(top level)"
            at = _line_of(text, loc)
            where = f"{source}, line {at}" if at else source
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: field {field!r}: {msg}")
        raise UserError(
            "invalid bench spec:\n"
            + "\n".join(lines)
            + "\nFields: tables (list of T), gpus (list of W), tasks, repeats, "
            "batch_size_per_rank, memory_factor (>= 1), seed, pool {seed, count, "
            "max_table_bytes, file}."
        ) from None


def load_spec(name_or_path: str) -> tuple[BenchSpec, Path | None]:
    """A built-in spec (``full``, ``quick``) or a spec file, and the file's folder
    (the base for ``pool.file``)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path], None
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise UserError(
            f"--tasks {name_or_path!r}: give a built-in spec ({', '.join(BUILTIN)}) or a "
            ".yaml/.json spec file."
        )
    return parse_spec(read_text(path, "bench spec"), str(path)), path.parent


def spec_json(spec: BenchSpec) -> dict[str, Any]:
    """The spec as plain JSON (what a results folder records and compares on resume)."""
    doc: dict[str, Any] = json.loads(spec.model_dump_json())
    return doc
