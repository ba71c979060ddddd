"""`shardwise calibrate`: fit the best cost model at hand to this machine and these tables."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from shardwise.basics import check_output_path
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    TABLES_HELP,
    MeasureOnOpt,
    deprecated,
    err,
    out,
    progress,
    renamed,
    say,
)

if TYPE_CHECKING:
    from shardwise.planner.costmodel.artifact import CostModel
    from shardwise.profiler.calibrate import CalibrationResult, Job


def _base_model(path: Path | None, fingerprint_key: str, job: Job) -> tuple[CostModel, str]:
    """``--base-model``, else this machine's cached model for these tables (the
    closest), else the bundled one; and how to name it in the calibration."""
    from shardwise.planner.costmodel.artifact import CostModel
    from shardwise.planner.costmodel.cache import ModelCache

    if path is not None:
        return CostModel.load(path), str(path)
    choice = ModelCache().select(
        fingerprint_key, list(job.tables), lambda line: say(f"warning: {line}")
    )
    say(f"base {choice.note}")
    return choice.model, str(choice.path) if choice.path is not None else "bundled"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _report(result: CalibrationResult) -> None:
    """What was measured, the factors, the held-out metrics and the time spent."""
    cal = result.calibration
    out.print("measured by this run (kernels by kind and global batch):")
    measured = Table()
    for col in ("kind", "global batch", "samples"):
        measured.add_column(col, justify="left" if col == "kind" else "right")
    for (kind, batch), n in sorted(result.measured.items()):
        measured.add_row(kind, str(batch), str(n))
    out.print(measured)
    totals = ", ".join(f"{n} {kind}" for kind, n in result.totals.items() if n)
    out.print(f"in {result.work_dir} now: {totals}")
    f = cal["speed_factors"]
    out.print(
        f"speed factors (measured / predicted by the base): fwd {f['fwd']:.3f}, "
        f"bwd {f['bwd']:.3f}, comm {f['comm']:.3f} (from {result.speed.compute_samples} "
        f"kernels and {result.speed.comm_samples} all-to-alls)"
    )
    m = cal["metrics"]
    n_tables = m["test_tables"] + m["val_tables"] + m["train_tables"]
    out.print(
        f"held-out: {m['test_tables']} of the job's {n_tables} tables, never trained on; "
        "plan-like kernels of them at the job's batch:"
    )
    table = Table()
    for col in ("model", "kernels", "MAPE", "fwd MAPE", "bwd MAPE", "Spearman", "pred/meas",
                "group max Spearman", "group max MAPE"):  # fmt: skip
        table.add_column(col, justify="left" if col == "model" else "right")
    for key, label in (("base", "base"), ("speed_only", "base + speed factors"),
                       ("final", "calibrated")):  # fmt: skip
        r = m[key]
        groups = f" ({r['groups']}×{r['group_size']})" if r.get("groups") else ""
        table.add_row(
            label,
            str(r.get("kernels", 0)),
            _pct(r.get("kernel_mape")),
            _pct(r.get("fwd_mape")),
            _pct(r.get("bwd_mape")),
            _num(r.get("kernel_spearman")),
            _num(r.get("median_ratio")),
            _num(r.get("group_max_spearman")) + groups,
            _pct(r.get("group_max_mape")),
        )
    out.print(table)
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result.phase_seconds.items())
    out.print(
        f"phases kept: {' + '.join(cal['phases'])}; time: {phases} (total {cal['seconds']:.0f} s)"
    )
    for note in result.notes:
        out.print(f"note: {note}", highlight=False)


def calibrate_cmd(
    ctx: typer.Context,
    tables_path: Annotated[
        Path, typer.Option("--tables", help=f"{TABLES_HELP}: the job's tables.")
    ],
    gpus: Annotated[int, typer.Option(min=1, help="GPUs (ranks) the job runs on.")] = 8,
    batch_per_rank: Annotated[
        int,
        typer.Option(
            min=1,
            help=f"{BATCH_PER_RANK_HELP}; kernels are measured at this × --gpus (the "
            "job's global batch), half and double it.",
        ),
    ] = 128,
    minutes: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Budget for all phases (speed ≤ 60 s, measuring, fine-tuning 10 %).",
        ),
    ] = 10.0,
    base_model: Annotated[
        Path | None,
        typer.Option(
            "--base-model",
            help="Model to calibrate.",
            show_default="this machine's cached model for these tables, else the bundled one",
        ),
    ] = None,
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Also write the calibrated model here.",
            show_default="the model cache only",
        ),
    ] = None,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            "--work-dir",
            help="Where the measured samples are kept (resumable datasets).",
            show_default="<model cache>/work/<machine>/<job>",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Split and sampling seed.")] = 0,
    from_scratch: Annotated[
        bool,
        typer.Option("--from-scratch", help="Train a new compute network instead of fine-tuning."),
    ] = False,
    measure_on: MeasureOnOpt = None,
    max_samples: Annotated[
        int | None,
        typer.Option("--max-samples", hidden=True, min=1, help="Cap on measuring indices."),
    ] = None,
    speed_samples: Annotated[
        int | None,
        typer.Option("--speed-samples", hidden=True, min=1, help="Cap on speed kernels."),
    ] = None,
    tiny: Annotated[
        bool, typer.Option("--tiny", hidden=True, help="Small networks from scratch (tests).")
    ] = False,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
) -> None:
    """Calibrate a cost model on this machine for the job's tables.

    Measures this machine's speed (about a minute), then augmented versions of the
    job's tables (each at its width and halvings, in random fused groups, at the job's
    global batch and its neighbours) and a reference set, then fine-tunes the model,
    all within --minutes. Prints held-out metrics on tables it never trained on.
    Writes the model to this machine's model cache, where `shardwise plan`, `evaluate`
    and `bench` pick it up, and to --out when given; the samples go to --work-dir.
    Ctrl-C keeps every sample: the same command resumes.

    Example: shardwise calibrate --tables tables.yaml --gpus 8 --batch-per-rank 128
    """
    from shardwise.planner.costmodel.cache import ModelCache, cache_root
    from shardwise.planner.tables import load_tables
    from shardwise.profiler.calibrate import Budget, Job, PhaseProgress, calibrate
    from shardwise.profiler.calibrate.pipeline import default_work_dir
    from shardwise.profiler.fingerprint import current_fingerprint

    batch_per_rank = renamed(ctx, "batch_per_rank", batch_per_rank, old_batch_size)
    budget = Budget(minutes * 60.0)
    if out_path is not None:
        check_output_path(out_path, "--out", "model.pt")
    job = Job(tuple(load_tables(tables_path)), gpus, batch_per_rank, seed)
    fingerprint = current_fingerprint(measure_on)
    base, base_name = _base_model(base_model, fingerprint.key(), job)
    work = work_dir or default_work_dir(cache_root(), fingerprint, job)
    try:
        with progress() as bar:
            task = bar.add_task("calibrating", total=int(budget.total_s))

            def on_progress(p: PhaseProgress) -> None:
                bar.update(task, completed=min(p.elapsed_s, p.budget_s), description=p.text)

            result = calibrate(
                job,
                base,
                base_name,
                work,
                budget,
                from_scratch=from_scratch,
                device=measure_on,
                max_samples=max_samples,
                tiny=tiny,
                **({"speed_samples": speed_samples} if speed_samples else {}),
                on_progress=on_progress,
            )
    except KeyboardInterrupt:
        err.print(
            f"interrupted: every measured sample is kept in {work}. To resume (it measures "
            "only what is missing, then fine-tunes), run the same command again:\n"
            f"  shardwise {shlex.join(sys.argv[1:])}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    _report(result)
    stored = ModelCache().store(result.model, fingerprint.key())
    out.print(f"stored the calibrated model in the model cache: {stored}", highlight=False)
    if out_path is not None:
        result.model.save(out_path)
        out.print(f"wrote {out_path}", highlight=False)
    out.print(
        f"`shardwise plan {shlex.quote(str(tables_path))} --gpus {gpus}` on this "
        "machine now prices with it (it prints which model it uses).",
        highlight=False,
    )
