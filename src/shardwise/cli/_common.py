"""Shared pieces of the CLI: the consoles, the progress bar, the options several
commands share (one name, one meaning, one help text), the old spellings of renamed
options, the checks of output paths and devices that run before any work, and the
choice of cost model every command that prices announces (docs/model-cache.md)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardwise.basics import UserError, check_output_path
from shardwise.planner.comm.choice import comm_choices, resolve_comm
from shardwise.planner.comm.model import CommModel

# Piped output (logs, CI, `make demo | tee`) gets room for the wide tables.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


T = TypeVar("T")

# --------------------------------------------------------------------------- shared options
#: Help texts of the options several commands share, so one option reads the same
#: everywhere (a command adds what the option does there).
TABLES_HELP = "Table specs (.yaml, .json or .csv)"
MODEL_HELP = "Cost model file (from `shardwise pretrain` or `shardwise calibrate`)"
BUNDLED_MODEL_DEFAULT = "the bundled CPU model"
#: What a command that chooses its model uses without --model (docs/model-cache.md).
CHOSEN_MODEL_DEFAULT = (
    "$SHARDWISE_MODEL, else this machine's calibrated model from the model cache, "
    "else the bundled CPU model"
)
MEASURE_ON_HELP = "Device that measures: cuda or cpu."
MEASURE_ON_DEFAULT = "cuda if present"
BATCH_PER_RANK_HELP = "Samples per GPU (rank) and iteration"
GLOBAL_BATCH_HELP = "Samples in one kernel call (a kernel's whole batch)"
REPEATS_HELP = "Times each plan is measured; the median over the repeats is reported"
SAMPLES_HELP = "Samples in the dataset when done."
DATASET_OUT_HELP = "Dataset directory (created, or resumed if it exists)."
TABLES_OUT_HELP = "Where to write the table specs (.yaml, .json or .csv by extension)."
COMM_HELP = f"How the embedding all-to-all is costed (docs/comm.md). {comm_choices()}."


_DEVICE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")


def _device_problem(value: str | None, option: str) -> str | None:
    if value is None or _DEVICE.match(value):
        return None
    return (
        f"{value!r} is not a device the measurements run on: give {option} cpu or "
        f"{option} cuda (cuda:N for one GPU)."
    )


def measure_device(value: str | None, option: str = "--measure-on") -> str | None:
    """``value`` if it names a device the benchmarks run on (cpu, cuda, cuda:N), else a
    :class:`UserError`; checked before any work, so a typo is no traceback from torch."""
    problem = _device_problem(value, option)
    if problem:
        raise UserError(f"{option}: {problem}")
    return value


def _check_measure_on(value: str | None) -> str | None:
    problem = _device_problem(value, "--measure-on")
    if problem:
        raise typer.BadParameter(problem)
    return value


MeasureOnOpt = Annotated[
    str | None,
    typer.Option(
        "--measure-on",
        help=MEASURE_ON_HELP,
        show_default=MEASURE_ON_DEFAULT,
        callback=_check_measure_on,
    ),
]


#: ``--comm``: one name, one meaning in every command that costs a plan (docs/comm.md).
CommOpt = Annotated[str, typer.Option("--comm", help=COMM_HELP)]


def choose_comm(
    value: str,
    *,
    world: int,
    device: str | None,
    predictor: Any,
    measuring: bool,
    label: str = "comm",
) -> CommModel:
    """The comm model ``--comm value`` names for a ``world``-rank job
    (:func:`~shardwise.planner.comm.choice.resolve_comm`; a bad value is a :class:`UserError`
    listing the values), announced in one line on stderr: ``{label}: …``.
    ``measuring``: for the evaluator; ``predictor``: the CostPredictor at hand, if any."""
    model = resolve_comm(
        value, world=world, device=device, predictor=predictor, measuring=measuring
    )
    say(f"{label}: {model.describe()}")
    return model


def model_option(use: str, chosen: bool = False) -> Any:
    """The ``--model`` option of a command that uses the cost model ``use`` (e.g.
    ``"for --predict"``); default: the bundled CPU model, or with ``chosen`` the model
    :func:`choose_model` picks."""
    return typer.Option(
        "--model",
        help=f"{MODEL_HELP} {use}.",
        show_default=CHOSEN_MODEL_DEFAULT if chosen else BUNDLED_MODEL_DEFAULT,
    )


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


# --------------------------------------------------------------------------- output paths
def check_plot_path(path: Path | None, option: str = "--plot") -> None:
    """Fail before the work when ``path`` cannot take a figure: an extension matplotlib
    has no writer for, or a place no file can be written (:func:`check_output_path`)."""
    if path is None:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lower().lstrip(".") not in formats:
        raise UserError(
            f"{option} {path}: cannot draw a {path.suffix or 'figure without an extension'}; "
            f"name it .png (or one of .{', .'.join(sorted(formats))})."
        )
    check_output_path(path, option, "plot.png")


def wrote_then_failed(written: Path, path: Path, option: str, err: Exception) -> UserError:
    """The error for a figure that failed after ``written`` was written (kept)."""
    return UserError(
        f"wrote {written}, but {option} {path} could not be drawn ({err}); "
        f"{written} is complete. Give {option} another path, or leave it out."
    )


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
    """Per-rank costs from the JSON shape shared by measured and predicted evaluations;
    comm is the pooled all-to-all and, for the other kinds, their collectives."""
    t = Table(title=title)
    for col in ("rank", "fwd compute", "bwd compute", "fwd comm", "bwd comm", "total"):
        t.add_column(col + ("" if col == "rank" else " ms"), justify="right")
    for r in doc["ranks"]:
        keys = ("fwd_compute_s", "bwd_compute_s", "fwd_comm_s", "bwd_comm_s", "total_s")
        t.add_row(str(r["rank"]), *(f"{1e3 * r[k]:.2f}" for k in keys))
    return t


def load_model(path: Path | None) -> Any:
    """The cost model at ``path`` (or the bundled one), refused when its metadata does
    not say which hardware it was measured on."""
    from shardwise.planner.costmodel.artifact import CostModel, load_bundled
    from shardwise.profiler.fingerprint import Fingerprint

    model = CostModel.load(path) if path is not None else load_bundled()
    if "fingerprint" not in model.metadata:
        raise UserError(
            f"{model.source}: the model's metadata has no 'fingerprint' (the hardware its "
            "costs were measured on), so nothing tells where its predictions hold. "
            "Re-train it with `shardwise pretrain`, which records it."
        )
    try:
        Fingerprint.from_dict(model.metadata["fingerprint"])
    except ValueError as e:
        raise UserError(
            f"{model.source}: metadata.fingerprint is damaged ({e}). "
            "Re-train it with `shardwise pretrain`."
        ) from None
    return model


def calibrate_command(tables: Path, gpus: int, batch_per_rank: int) -> str:
    """The `shardwise calibrate` line that makes predictions hold for these tables here."""
    return (
        f"shardwise calibrate --tables {shlex.quote(str(tables))} --gpus {gpus} "
        f"--batch-per-rank {batch_per_rank}"
    )


def say(line: str) -> None:
    """One line on stderr, never wrapped (paths in it are not markup)."""
    err.print(line, markup=False, highlight=False, soft_wrap=True)


def choose_model(
    model_path: Path | None,
    tables: Sequence[Any],
    calibrate: str,
    device: str | None = None,
) -> Any:
    """The :class:`~shardwise.planner.costmodel.ModelChoice` a command prices with,
    announced in one line (docs/model-cache.md), or None when no model is at hand.

    ``--model`` (``model_path``) wins, then ``$SHARDWISE_MODEL``, then this machine's
    cached model covering the tables (else the closest), then the bundled one. A model
    not calibrated on these tables on this machine adds one line: ``calibrate``, the
    command that calibrates it. ``device`` picks the machine's fingerprint (cpu, cuda).
    """
    from shardwise.planner.costmodel import BUNDLED_MODEL, ENV_MODEL, ModelCache, ModelChoice
    from shardwise.profiler.fingerprint import current_fingerprint

    here = current_fingerprint(device).key()
    from_env = os.environ.get(ENV_MODEL, "")
    choice: Any
    if model_path is not None:
        choice = ModelChoice.of_model(load_model(model_path), model_path, "--model", here, tables)
    elif from_env:
        try:
            model = load_model(Path(from_env))
        except UserError as e:
            raise UserError(
                f"${ENV_MODEL}={from_env}: {e} Or unset {ENV_MODEL}: Shardwise then picks "
                "this machine's calibrated model (docs/model-cache.md)."
            ) from None
        choice = ModelChoice.of_model(model, Path(from_env), ENV_MODEL, here, tables)
    else:
        choice = ModelCache().best(here, tables, lambda line: say(f"warning: {line}"))
        if choice is None:
            if not BUNDLED_MODEL.exists():
                return None
            choice = ModelChoice.of_model(load_model(None), None, "bundled", here, tables)
    say(choice.note)
    from shardwise.planner.costmodel.rankhead import reliability_warning

    warning = reliability_warning(choice.model.metadata)
    if warning is not None:
        say(f"warning: {warning}")
    if not choice.holds_here:
        then = {"--model": "then leave out --model", ENV_MODEL: f"then unset {ENV_MODEL}"}
        say(
            "note: for predictions that hold on these tables and this machine, calibrate "
            "(about 10 minutes), "
            f"{then.get(choice.origin, 'which later commands then pick by themselves')}: "
            f"{calibrate}"
        )
    return choice


def warn_plan_kinds(predictor: Any, plan: Any) -> str | None:
    """After planning: one ``warning:`` line when ``plan`` uses a row-wise,
    table-row-wise, grid or data-parallel kind that ``predictor``'s model's calibration
    did not judge, or judged unreliable
    (:func:`~shardwise.planner.costmodel.rankhead.kind_warnings`); the line, or None.
    The overall verdict was said when the model was chosen (:func:`choose_model`)."""
    from shardwise.planner.costmodel.rankhead import kind_warnings

    if predictor is None or plan is None:
        return None
    lines = kind_warnings(predictor.model.metadata, plan.kinds())
    if not lines:
        return None
    line = "; ".join(lines)
    say(f"warning: {line}")
    return line


def batch_check(choice: Any, batch: int, job_batch: int | None, calibrate: str) -> None:
    """Say in one line when predictions at global ``batch`` (or the job's own global
    batch) leave the range the chosen model was trained on (docs/model-cache.md); the
    ``calibrate`` command unless :func:`choose_model` printed it already."""
    from shardwise.planner.costmodel import batch_note, trained_batches

    line = batch_note(
        trained_batches(choice.model.metadata),
        batch,
        job_batch=job_batch,
        calibrate=calibrate if choice.holds_here else None,
    )
    if line is not None:
        say(line)


def cost_predictor(
    model_path: Path | None,
    tables: Sequence[Any],
    calibrate: str,
    batch: int,
    job_batch: int | None = None,
) -> Any:
    """A cost predictor over :func:`choose_model`'s model, its batch range checked at
    global ``batch`` (:func:`batch_check`), or None (with a note) when no model is at
    hand."""
    from shardwise.planner.costmodel import CostPredictor

    choice = choose_model(model_path, tables, calibrate)
    if choice is None:
        err.print("note: no bundled cost model in this install; plans are not priced.")
        return None
    batch_check(choice, batch, job_batch, calibrate)
    return CostPredictor(choice.model)
