"""Shared pieces of the CLI: the consoles, the progress bar, the options several
commands share (one name, one meaning, one help text), the old spellings of renamed
options, and cost-model helpers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardwise.basics import UserError

# Piped output (logs, CI, `make demo | tee`) gets room for the wide tables.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


T = TypeVar("T")

# --------------------------------------------------------------------------- shared options
#: Help texts of the options several commands share, so one option reads the same
#: everywhere (a command adds what the option does there).
TABLES_HELP = "Table specs (.yaml, .json or .csv)"
MODEL_HELP = "Cost model file (from `shardwise pretrain`)"
BUNDLED_MODEL_DEFAULT = "the bundled CPU model"
MEASURE_ON_HELP = "Device that measures: cuda or cpu."
MEASURE_ON_DEFAULT = "cuda if present"
BATCH_PER_RANK_HELP = "Samples per GPU (rank) and iteration"
GLOBAL_BATCH_HELP = "Samples in one kernel call (a kernel's whole batch)"
REPEATS_HELP = "Times each plan is measured; the median over the repeats is reported"
SAMPLES_HELP = "Samples in the dataset when done."
DATASET_OUT_HELP = "Dataset directory (created, or resumed if it exists)."
TABLES_OUT_HELP = "Where to write the table specs (.yaml, .json or .csv by extension)."


MeasureOnOpt = Annotated[
    str | None,
    typer.Option("--measure-on", help=MEASURE_ON_HELP, show_default=MEASURE_ON_DEFAULT),
]


def model_option(use: str) -> Any:
    """The ``--model`` option of a command that uses the cost model ``use`` (e.g.
    ``"for --predict"``); default: the bundled CPU model."""
    return typer.Option("--model", help=f"{MODEL_HELP} {use}.", show_default=BUNDLED_MODEL_DEFAULT)


def deprecated(old: str, new: str, **kwargs: Any) -> Any:
    """A hidden option, the old spelling ``old`` of option ``new``, accepted for one
    release: using it prints a note on stderr. :func:`renamed` picks its value."""

    def note(value: Any) -> Any:
        if value is not None and value != []:
            err.print(
                f"[yellow]note:[/yellow] {old} is deprecated and will be removed in the next "
                f"release; use {new}.",
                highlight=False,
            )
        return value

    return typer.Option(old, hidden=True, callback=note, **kwargs)


def renamed(ctx: typer.Context, name: str, value: T, old_value: T | None) -> T:
    """The value of the option whose parameter is ``name``, or ``old_value`` when its
    deprecated spelling (:func:`deprecated`) was given instead. Both is an error."""
    if old_value is None or old_value == []:
        return value
    source = ctx.get_parameter_source(name)
    if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
        flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
        raise UserError(f"{flag} was given twice, once by its old name; give it once, as {flag}.")
    return old_value


# --------------------------------------------------------------------------- output
def progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )


def cost_table(title: str, doc: dict[str, Any]) -> Table:
    """Per-rank costs from the JSON shape shared by measured and predicted evaluations."""
    t = Table(title=title)
    for col in ("rank", "fwd compute", "bwd compute", "fwd a2a", "bwd a2a", "total"):
        t.add_column(col + ("" if col == "rank" else " ms"), justify="right")
    for r in doc["ranks"]:
        keys = ("fwd_compute_s", "bwd_compute_s", "fwd_comm_s", "bwd_comm_s", "total_s")
        t.add_row(str(r["rank"]), *(f"{1e3 * r[k]:.2f}" for k in keys))
    return t


def load_model(path: Path | None) -> Any:
    """The cost model at ``path`` (or the bundled one), with a word if the device differs."""
    from shardwise.planner.costmodel.artifact import CostModel, load_bundled
    from shardwise.profiler.fingerprint import Fingerprint, current_fingerprint

    model = CostModel.load(path) if path is not None else load_bundled()
    trained_on = Fingerprint.from_dict(model.metadata["fingerprint"])
    here = current_fingerprint()
    if not trained_on.matches(here):
        err.print(
            f"[yellow]note:[/yellow] {trained_on.describe_mismatch(here)} "
            "Predictions are for the hardware the model was trained on."
        )
    return model


def cost_predictor(model_path: Path | None) -> Any:
    """A cost predictor, or None (with a note) when no model is at hand."""
    from shardwise.planner.costmodel import BUNDLED_MODEL, CostPredictor

    if model_path is None and not BUNDLED_MODEL.exists():
        err.print("note: no bundled cost model in this install; plans are not priced.")
        return None
    return CostPredictor(load_model(model_path))
