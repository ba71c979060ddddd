"""What a benchmark run measures (docs/design.md §9): its families, task grid and settings.

A spec is a small YAML or JSON file, or one of the built-in ones (``full``: the
protocol of docs/bench.md, about 25 minutes on 2 cores; ``quick``: the same protocol
cut to four small tasks and the bundled model, for ``make test``; ``heavy``: three
tight tasks of 60-100 big, heavily read tables on 8 and 16 GPUs at 1,024 samples per
rank, about an hour; ``industrial``: two tight tasks of 40 tables, some larger than a
GPU, on 8 GPUs at 1,024 samples per rank, 5-minute calibrations per task; ``anchor``:
TorchRec at full strength against its restriction on the heavy and industrial pools).
Errors name the file, the line and the field, and say what a valid value looks like.

**Held out from pre-training.** The bundled cost model was pre-trained on the
calibrated generator's tables of seed 7 and the broad family's of seed 11, and judged
on the held-out family of seed 2027 (the Makefile's ``pretrain``); calibration adds
the generator's seed 17 as its reference set. Those (family, seed) pairs are refused
(:data:`RESERVED_SEEDS`), so every table a task draws is one the bundled model never
saw. ``file`` pools are the user's to vouch for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardwise.basics import UserError, parse_bytes, read_text

#: (family, seed) pairs the bundled model or calibration has seen (module docstring).
RESERVED_SEEDS: dict[tuple[str, int], str] = {
    ("calibrated", 7): "the bundled cost model's pre-training pool",
    ("broad", 11): "the bundled cost model's pre-training pool",
    ("heldout", 2027): "the held-out set the bundled cost model was judged on",
    ("calibrated", 17): "calibration's reference set",
}
#: Tables above this are left out of a pool: the evaluator holds a rank's weights in
#: host memory, and a 40-table task of multi-GiB tables would spend minutes allocating.
DEFAULT_MAX_TABLE_BYTES = 256 * 2**20
#: Tables read more often per sample are left out: a kernel's time grows with its
#: lookups, and the full run must fit about 30 minutes on 2 cores (docs/bench.md).
DEFAULT_MAX_POOLING = 50.0
#: ``shardwise calibrate``'s shortest budget (the pipeline's ``MIN_BUDGET_S``).
MIN_CALIBRATION_S = 20.0
#: Pooling factors and histograms of generated tables are measured on this batch.
POOL_HISTOGRAM_BATCH = 16384

#: The NeuroShard rows a spec may ask for: the model it searches with, and whether
#: measured refinement follows (``torchrec+refined``: TorchRec's plan refined). A
#: ``-tw-cw`` variant searches table-wise/column-wise only (planner
#: ``neuroshard-tw-cw``): the row every-kind NeuroShard must never lose to.
VARIANTS = (
    "bundled",
    "calibrated",
    "bundled+refined",
    "calibrated+refined",
    "torchrec+refined",
    "bundled-tw-cw",
    "calibrated-tw-cw",
)
#: The suffix of the variants restricted to table-wise/column-wise.
TW_CW = "-tw-cw"


class PoolSpec(BaseModel):
    """One family's pool: ``count`` tables of ``family`` drawn with ``seed``, or a
    tables file; tables above ``max_table_bytes`` or ``max_pooling`` are left out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Literal["calibrated", "broad", "heldout", "heavy", "industrial"] | None = None
    seed: int = Field(default=0, ge=0)
    count: int = Field(default=160, ge=1, le=100_000)
    #: A tables file (.yaml/.json/.csv) instead of a family, relative to the spec.
    file: str | None = None
    max_table_bytes: int = Field(default=DEFAULT_MAX_TABLE_BYTES, gt=0)
    max_pooling: float = Field(default=DEFAULT_MAX_POOLING, gt=0)
    #: How its tasks' GPUs are sized (docs/bench.md): ``packing``, on our packing of the
    #: whole tables (no table is larger than a GPU); ``balanced``, by the tables' total,
    #: so a table holding a large share of it fits no GPU whole and is cut row-wise.
    sizing: Literal["packing", "balanced"] = "packing"

    @field_validator("max_table_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_bytes(value, "max_table_bytes") if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> PoolSpec:
        if (self.family is None) == (self.file is None):
            raise ValueError("give either family (with seed and count) or file")
        if self.family is not None and (self.family, self.seed) in RESERVED_SEEDS:
            used = RESERVED_SEEDS[(self.family, self.seed)]
            raise ValueError(
                f"the {self.family} family's seed {self.seed} drew {used}; use another seed"
            )
        return self

    @property
    def key(self) -> str:
        """The pool's name in results and file names: ``heldout-4049`` or the file's stem."""
        if self.family is not None:
            return f"{self.family}-{self.seed}"
        return Path(self.file or "pool").stem


class Shape(BaseModel):
    """T tables for W GPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tables: int = Field(ge=1, le=100_000)
    gpus: int = Field(ge=1, le=1024)


class BenchSpec(BaseModel):
    """Every (pool, shape, fill) gets ``tasks`` draws; see docs/bench.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pools: list[PoolSpec] = Field(min_length=1)
    shapes: list[Shape] = Field(min_length=1)
    #: Fill of the tightest GPU in the best packing we find, drawn per task from the
    #: range: ``tight`` as in the NeuroShard paper, ``slack`` for comparison.
    fills: dict[str, tuple[float, float]] = Field(
        default_factory=lambda: {"tight": (0.85, 0.95), "slack": (0.45, 0.6)}, min_length=1
    )
    tasks: int = Field(default=1, ge=1, le=1000, description="tasks per pool, shape and fill")
    repeats: int = Field(default=3, ge=2, le=100, description="side-by-side evaluations")
    #: The job's global batch; each task's batch per rank is this / W.
    global_batch: int = Field(default=8192, ge=1)
    #: Instead of one global batch: this many samples per rank, so a task on W GPUs
    #: runs at global batch ``batch_per_rank x W`` (the job grows with its GPUs).
    batch_per_rank: int | None = Field(default=None, ge=1, le=2**24)
    seed: int = 0
    #: Calibration budget per pool (``shardwise calibrate --minutes``); 0: none, and the
    #: calibrated rows are left out.
    calibration_minutes: float = Field(default=2.0, ge=0.0, le=120.0)
    #: What a calibration is for: each ``pool`` once (its tables, the largest W), or each
    #: ``task`` as a job is calibrated (its own tables, W, batch and GPU memory).
    calibrate_on: Literal["pool", "task"] = "pool"
    #: Measured refinement's budget per plan refined.
    refine_budget_s: float = Field(default=20.0, gt=0.0, le=3600.0)
    variants: list[str] = Field(
        default_factory=lambda: ["bundled", "calibrated", "calibrated+refined"], min_length=1
    )

    @field_validator("fills")
    @classmethod
    def _fills(cls, fills: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for name, (lo, hi) in fills.items():
            if name not in ("tight", "slack"):
                raise ValueError(f"{name!r}: the fills are named tight and slack")
            if not 0.0 < lo <= hi <= 1.0:
                raise ValueError(f"{name}: a range 0 < low <= high <= 1, got [{lo}, {hi}]")
        return fills

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: list[str]) -> list[str]:
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown variant {bad[0]!r}; use some of {', '.join(VARIANTS)}")
        if len(set(variants)) != len(variants):
            raise ValueError(f"variants repeat: {variants}")
        return variants

    @field_validator("calibration_minutes")
    @classmethod
    def _calibration(cls, minutes: float) -> float:
        if 0 < minutes * 60 < MIN_CALIBRATION_S:
            raise ValueError(
                f"a calibration needs at least {MIN_CALIBRATION_S / 60:.2f} minutes "
                f"({MIN_CALIBRATION_S:.0f} s); give 0 for none"
            )
        return minutes

    @model_validator(mode="after")
    def _batch_divides(self) -> BenchSpec:
        keys = [p.key for p in self.pools]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two pools have one name: {keys}")
        if self.batch_per_rank is not None:
            if "global_batch" in self.model_fields_set:
                raise ValueError(
                    "give global_batch (one for every task) or batch_per_rank (each task "
                    "at batch_per_rank x W), not both"
                )
            return self
        bad = [s.gpus for s in self.shapes if self.global_batch % s.gpus]
        if bad:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of W {bad[0]}: every "
                "rank gets global_batch / W samples"
            )
        return self

    def rank_batch(self, gpus: int) -> int:
        """Samples per rank of a task on ``gpus`` GPUs."""
        if self.batch_per_rank is not None:
            return self.batch_per_rank
        return self.global_batch // gpus

    def batch_text(self) -> str:
        """``global batch 8192`` or ``batch 1024 per rank (global 8192-16384)``."""
        if self.batch_per_rank is None:
            return f"global batch {self.global_batch}"
        worlds = sorted({s.gpus for s in self.shapes})
        ends = sorted({self.batch_per_rank * worlds[0], self.batch_per_rank * worlds[-1]})
        return f"batch {self.batch_per_rank} per rank (global {'-'.join(map(str, ends))})"

    def task_count(self) -> int:
        return len(self.pools) * len(self.shapes) * len(self.fills) * self.tasks

    def calibrates(self) -> bool:
        return self.calibration_minutes > 0 and any("calibrated" in v for v in self.variants)


#: docs/bench.md, "The full run": 2 pools x 3 shapes x 2 fills x 2 = 24 tasks at global
#: batch 8,192, two 2-minute calibrations, refinements of up to 20 s (they stop early when
#: no move helps); about 25 minutes on a quiet 2-core machine.
FULL = BenchSpec(
    pools=[
        PoolSpec(family="heldout", seed=4049, count=160),
        PoolSpec(family="broad", seed=4051, count=200),
    ],
    shapes=[Shape(tables=10, gpus=2), Shape(tables=16, gpus=4), Shape(tables=24, gpus=8)],
    tasks=2,
)
#: ``make test``: four small tasks of light tables, the bundled model only (no
#: calibration), 8-s refinements; a check that the protocol runs, not figures to quote.
QUICK = BenchSpec(
    pools=[
        PoolSpec(family="heldout", seed=4049, count=40, max_table_bytes=64 * 2**20, max_pooling=20),
        PoolSpec(family="broad", seed=4051, count=60, max_table_bytes=64 * 2**20, max_pooling=20),
    ],
    shapes=[Shape(tables=8, gpus=2)],
    global_batch=4096,
    calibration_minutes=0.0,
    refine_budget_s=8.0,
    variants=["bundled", "bundled+refined"],
)
#: docs/bench.md, "The heavy run": the heavy family (tables up to 1 GiB, pooling up to
#: 100) at 1,024 samples per rank, the shape of docs/design.md §14's failure (100 tables
#: on 8 GPUs) and two others, memory tight only: 3 tasks, 5 repeats (a median sets aside
#: a preempted repeat where a mean would average it into the per-rank figures the models
#: are judged on; three were too few to decide the 16-rank task, whose repeats spread by
#: up to ~20 %: one plan's slowest rank measured 119-179 ms over three). Probed on the
#: 2-core machine (CPU): one measured round of a plan's ranks (build + 15 calls each)
#: took 24 s at T60 x W8, 44 s at T100 x W8 and 56 s at T80 x W16, one table alone
#: 0.5-0.7 s; with ~8 distinct plans a task, 3-minute refinements and a 5-minute
#: calibration per task (on its own tables, as a job is calibrated), under an hour (48
#: minutes measured with five repeats, 40 with three: docs/bench.md). NeuroShard
#: restricted to table-wise/column-wise (``calibrated-tw-cw``) is a row beside every
#: kind, so each task shows what the kinds add (one more plan a task to measure).
HEAVY = BenchSpec(
    pools=[
        PoolSpec(family="heavy", seed=4093, count=160, max_table_bytes=2**30, max_pooling=100.0),
    ],
    shapes=[Shape(tables=60, gpus=8), Shape(tables=100, gpus=8), Shape(tables=80, gpus=16)],
    fills={"tight": (0.85, 0.95)},
    repeats=5,
    batch_per_rank=1024,
    calibration_minutes=5.0,
    calibrate_on="task",
    refine_budget_s=180.0,
    variants=["bundled", "calibrated", "calibrated+refined", "calibrated-tw-cw"],
)
#: docs/bench.md, "The industrial run": the industrial family (giant tables of 256 MiB-1
#: GiB among small ones) with GPUs sized by the tasks' total (``sizing: balanced``), so
#: the giants holding a large share of it fit no GPU whole; 1,024 samples per rank on 8
#: GPUs, memory tight only, 2 tasks of 40 tables, 5 repeats (its ranks of ~20 ms lie
#: within ~20 % of each other, so ordering them needs the noise low; a repeat of a
#: task's plans takes ~20 s), a 5-minute calibration
#: per task on its own tables (as for the heavy run: the giants' row ranges are what
#: it must price), the bundled and calibrated rows, refined, and calibrated NeuroShard
#: restricted to table-wise/column-wise beside every kind.
INDUSTRIAL = BenchSpec(
    pools=[
        PoolSpec(
            family="industrial",
            seed=4201,
            count=160,
            max_table_bytes=2**30,
            max_pooling=50.0,
            sizing="balanced",
        ),
    ],
    shapes=[Shape(tables=40, gpus=8)],
    fills={"tight": (0.85, 0.95)},
    tasks=2,
    repeats=5,
    batch_per_rank=1024,
    calibration_minutes=5.0,
    calibrate_on="task",
    refine_budget_s=60.0,
    variants=[
        "bundled",
        "bundled+refined",
        "calibrated",
        "calibrated+refined",
        "calibrated-tw-cw",
    ],
)
#: docs/bench.md, "TorchRec at full strength": the anchor against its table-wise/
#: column-wise restriction on the heavy and the industrial pools, 60 tables on 8 GPUs at
#: 1,024 samples per rank, tight, 2 tasks each, 2 repeats; meant for
#: ``--planners torchrec,torchrec-tw-cw`` (no calibration).
ANCHOR = BenchSpec(
    pools=[HEAVY.pools[0], INDUSTRIAL.pools[0]],
    shapes=[Shape(tables=60, gpus=8)],
    fills={"tight": (0.85, 0.95)},
    tasks=2,
    repeats=2,
    batch_per_rank=1024,
    calibration_minutes=0.0,
    variants=["bundled"],
)
BUILTIN: dict[str, BenchSpec] = {
    "full": FULL,
    "quick": QUICK,
    "heavy": HEAVY,
    "industrial": INDUSTRIAL,
    "anchor": ANCHOR,
}

FIELDS_HELP = (
    "Fields: pools (list of {family: heldout|broad|heavy|industrial|calibrated, seed, "
    "count} or {file}, each with max_table_bytes, max_pooling, sizing: packing|balanced), "
    "shapes (list of {tables, gpus}), "
    "fills ({tight: [lo, hi], slack: [lo, hi]}), tasks, repeats, global_batch or "
    "batch_per_rank, seed, "
    "calibration_minutes, calibrate_on (pool or task), refine_budget_s, "
    f"variants (some of {', '.join(VARIANTS)})."
)


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
            f"{source}: a bench spec is a mapping such as {{pools: [{{family: heldout, "
            f"seed: 5}}], shapes: [{{tables: 10, gpus: 2}}]}}; found {type(doc).__name__}."
        )
    if "global_batch" in doc and "batch_per_rank" in doc:  # the validator's, with its line
        at = _line_of(text, ("batch_per_rank",))
        raise UserError(
            f"invalid bench spec:\n{source}, line {at}: field 'batch_per_rank': give "
            "global_batch (one for every task) or batch_per_rank (each task at "
            "batch_per_rank x W), not both\n" + FIELDS_HELP
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
        raise UserError("invalid bench spec:\n" + "\n".join(lines) + "\n" + FIELDS_HELP) from None


def load_spec(name_or_path: str) -> tuple[BenchSpec, Path | None]:
    """A built-in spec (``full``, ``quick``, ``heavy``) or a spec file, and the file's folder
    (the base for ``file`` pools)."""
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
    """The spec as plain JSON (what a results folder records and compares on resume).

    Only the batch field in force is written: a spec without ``batch_per_rank`` reads
    as it did before that field existed (so earlier results folders resume), and the
    JSON parses back to the same spec."""
    doc: dict[str, Any] = json.loads(spec.model_dump_json())
    doc.pop("global_batch" if spec.batch_per_rank is not None else "batch_per_rank")
    if spec.calibrate_on == "pool":  # as before the field existed: old folders resume
        doc.pop("calibrate_on")
    for pool in doc["pools"]:
        if pool.get("sizing") == "packing":  # likewise
            pool.pop("sizing")
    return doc
