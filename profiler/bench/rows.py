"""The benchmark's rows (``shardwise bench --planners``): which planner plans, with
which cost model, and which row's plan a refined row starts from."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.basics import UserError
from shardwise.planner.registry import MODEL_PLANNERS, planner_names
from shardwise.profiler.bench.spec import TW_CW, VARIANTS, BenchSpec

NEUROSHARD = "neuroshard"


@dataclass(frozen=True)
class Row:
    """One line of the figures: a planner, the model it searches with, and the row
    whose plan it refines (refined rows)."""

    name: str
    planner: str
    model: str | None = None  # "bundled" / "calibrated" for rows with a cost model
    start: str | None = None  # refined rows: the row whose plan is refined

    @property
    def refined(self) -> bool:
        return self.start is not None


def variant_row(variant: str, calibrates: bool) -> Row:
    """The row of a spec variant (:data:`~shardwise.profiler.bench.spec.VARIANTS`):
    ``calibrated-tw-cw`` plans with ``neuroshard-tw-cw`` and the calibrated model."""
    if variant == "torchrec+refined":
        return Row(variant, "torchrec", "calibrated" if calibrates else "bundled", "torchrec")
    model, _, refined = variant.partition("+")
    name = f"{NEUROSHARD}[{variant}]"
    if model.endswith(TW_CW):
        return Row(name, NEUROSHARD + TW_CW, model.removesuffix(TW_CW))
    return Row(name, NEUROSHARD, model, f"{NEUROSHARD}[{model}]" if refined else None)


def _restricted(spec: BenchSpec) -> list[str]:
    """The variants ``--planners neuroshard-tw-cw`` names: the spec's table-wise/
    column-wise ones, else the restricted twin of each model the spec plans with."""
    own = [v for v in spec.variants if v.endswith(TW_CW)]
    if own:
        return own
    plain = ("bundled", "calibrated")
    models = dict.fromkeys(v.partition("+")[0] for v in spec.variants if v in plain)
    return [f"{m}{TW_CW}" for m in models] or [f"bundled{TW_CW}"]


def resolve_rows(text: str, spec: BenchSpec) -> list[Row]:
    """``all`` (every registered planner, NeuroShard as the spec's variants) or a comma
    list of planner names, ``neuroshard`` (the spec's variants, its table-wise/
    column-wise ones included), ``neuroshard-tw-cw`` (those alone, or the restricted
    twin of each model the spec plans with) and row names such as
    ``neuroshard[calibrated+refined]`` or ``torchrec+refined``. A refined row brings
    the row it starts from. NeuroShard's planners are rows only with a model, so
    neither is a row of its own."""
    calibrates = spec.calibration_minutes > 0
    base = [n for n in planner_names() if n not in MODEL_PLANNERS]
    by_name = {r.name: r for r in (variant_row(v, calibrates) for v in VARIANTS)}
    names = [n.strip() for n in text.split(",") if n.strip()]
    wanted: list[Row] = []
    for name in names:
        if name == "all":
            wanted += [Row(n, n) for n in base] + [by_name[_row_name(v)] for v in spec.variants]
        elif name == NEUROSHARD:
            wanted += [by_name[_row_name(v)] for v in spec.variants if v != "torchrec+refined"]
        elif name == NEUROSHARD + TW_CW:
            wanted += [by_name[_row_name(v)] for v in _restricted(spec)]
        elif name in base:
            wanted.append(Row(name, name))
        elif name in by_name:
            wanted.append(by_name[name])
        else:
            raise UserError(
                f"--planners: unknown planner {name!r}; use 'all' or a comma list of: "
                f"{', '.join([*base, NEUROSHARD, NEUROSHARD + TW_CW, *by_name])}."
            )
    if not wanted:
        raise UserError("--planners names no planner; use 'all' or a comma list.")
    out: dict[str, Row] = {}
    for row in wanted:
        if row.start is not None and row.start not in out:
            out[row.start] = by_name.get(row.start) or Row(row.start, row.start)
        out.setdefault(row.name, row)
    rows = list(out.values())
    if not calibrates and any(r.model == "calibrated" for r in rows):
        raise UserError(
            "the calibrated rows need a calibration: the spec's calibration_minutes is 0. "
            "Give calibration_minutes > 0 (or --calibration-minutes), or leave them out."
        )
    return rows


def _row_name(variant: str) -> str:
    return variant if variant == "torchrec+refined" else f"{NEUROSHARD}[{variant}]"
