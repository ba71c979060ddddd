"""`shardwise calibrate`: fit the best cost model at hand to this machine and these tables."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from shardwise.basics import check_output_path, parse_bytes
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
    """What was measured, the factors, the rank head, the held-out metrics with the
    ablation of the fusion's inputs, the verdict and the time spent."""
    from shardwise.planner.costmodel.rankhead import VERDICT_MIN_RANKS

    cal = result.calibration
    names = {"anchor": "tables alone (anchors)", "anchor (again)": "anchors timed again",
             "rank": "ranks of training plans",
             "heldout": "ranks of held-out plans", "comm": "all-to-alls"}  # fmt: skip
    got = ", ".join(f"{n} {names.get(k, k)}" for k, n in sorted(result.measured.items()) if n)
    out.print(f"measured by this run: {got or 'nothing new'}", highlight=False)
    totals = ", ".join(f"{n} {names.get(k, k)}" for k, n in result.totals.items() if n)
    out.print(f"in {result.work_dir} now: {totals}", highlight=False)
    f = cal["speed_factors"]
    out.print(
        f"speed factors (measured / predicted by the base): fwd {f['fwd']:.3f}, "
        f"bwd {f['bwd']:.3f}, comm {f['comm']:.3f} (from {result.speed.compute_samples} "
        f"kernels and {result.speed.comm_samples} all-to-alls)"
    )
    head = cal["rank_head"]
    whole = set(cal["tables"])
    anchored = len(whole & set(head["anchors"]))
    widths = sum(len(v) for k, v in head["anchors"].items() if k in whole)
    ranges = len(set(head["anchors"]) - whole)
    copies = len(head.get("local_anchors") or {})
    fusion = head["fusion"]
    chosen = cal.get("fusion") or {}
    inputs = sorted({*chosen.get("fwd", []), *chosen.get("bwd", [])})
    out.print(
        f"rank head: {anchored} of the job's {len(cal['tables'])} tables timed alone "
        f"({widths} widths), {ranges} row ranges and {copies} data-parallel copies at "
        f"the batch per rank; a rank costs its kernels' anchors, with a kernel's own "
        f"{1e3 * head['overhead'][0]:.2f} ms forward and {1e3 * head['overhead'][1]:.2f} ms "
        f"backward counted once, times exp({fusion['fwd']['bias']:+.3f}) forward, "
        f"exp({fusion['bwd']['bias']:+.3f}) backward"
        + (
            f", adjusted by {', '.join(inputs)}" if inputs else " (no rank input lowered the error)"
        ),
        highlight=False,
    )
    m = cal["metrics"]
    n_tables = m["test_tables"] + m["train_tables"]
    final = m["final"]
    out.print(
        f"held-out: {m['test_tables']} of the job's {n_tables} tables, in no fitted rank; "
        f"{final.get('ranks', 0)} ranks of {final.get('plans', 0)} candidate plans for "
        "them, at the job's batch:"
    )
    table = Table()
    for col in ("model", "ranks", "rank Spearman", "rank MAPE", "σ", "pred/meas",
                "plan-max Spearman", "plan-max MAPE"):  # fmt: skip
        table.add_column(col, justify="left" if col == "model" else "right")
    for key, label in (("base", "base"), ("speed_only", "base + speed factors"),
                       ("final", "calibrated")):  # fmt: skip
        _metrics_row(table, label, m[key])
    out.print(table)
    _kinds_report(final.get("kinds") or {}, cal["verdict"].get("kinds") or {})
    if cal.get("ablation"):
        out.print("why a rank costs other than its parts: the fusion's inputs, held out")
        ablation = Table()
        for col in ("inputs", "rank Spearman", "rank MAPE", "σ", "pred/meas",
                    "plan-max Spearman", "plan-max MAPE"):  # fmt: skip
            ablation.add_column(col, justify="left" if col == "inputs" else "right")
        for row in cal["ablation"]:
            _metrics_row(ablation, row["inputs"], row, ranks=False)
        out.print(ablation)
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result.phase_seconds.items())
    out.print(
        f"phases kept: {' + '.join(cal['phases'])}; time: {phases} (total {cal['seconds']:.0f} s)"
    )
    if cal.get("budget_s"):
        out.print(
            f"budget: used {cal['seconds']:.0f} s of {cal['budget_s']:.0f} s; the ranks stopped "
            f"because {_stopped(str(cal.get('stopped', 'budget')))}",
            highlight=False,
        )
    for note in result.notes:
        out.print(f"note: {note}", highlight=False)
    level = cal["verdict"]["level"]
    style = {"reliable": "green", "refine": "yellow"}.get(level, "red")
    out.print(f"[{style}]verdict:[/{style}] {cal['verdict']['text']}", highlight=False)
    unjudged = [
        k.replace("_", "-")
        for k, v in (cal["verdict"].get("kinds") or {}).items()
        if v.get("level") == "unjudged"
    ]
    if unjudged:
        out.print(
            f"unjudged kinds: {', '.join(unjudged)} (fewer than {VERDICT_MIN_RANKS} held-out "
            "ranks held them): "
            "a plan that uses them says so",
            highlight=False,
        )


def _kinds_report(metrics: dict[str, Any], verdicts: dict[str, Any]) -> None:
    """The calibrated model on the held-out ranks holding each kind, with its level."""
    if not metrics:
        return
    out.print(
        "by kind: held-out ranks holding a shard of each kind (table-wise and column-wise: "
        "ranks of fused shards alone), and the training ranks that held it:"
    )
    table = Table()
    for col in ("kind", "ranks", "fitted", "rank Spearman", "rank MAPE", "σ", "pred/meas",
                "level"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("kind", "level") else "right")
    for kind, m in metrics.items():
        table.add_row(
            kind.replace("_", "-"),
            str(m.get("ranks", 0)),
            str(m.get("fitted", 0)),
            _num(m.get("rank_spearman")),
            _pct(m.get("rank_mape")),
            _pct(m.get("sigma")),
            _num(m.get("median_ratio")),
            str((verdicts.get(kind) or {}).get("level", "-")),
        )
    out.print(table)


def _stopped(reason: str) -> str:
    if reason == "budget":
        return "the budget ended (a longer one measures more ranks)"
    return reason


def _metrics_row(table: Table, label: str, r: dict[str, Any], ranks: bool = True) -> None:
    cells = [
        _num(r.get("rank_spearman")),
        _pct(r.get("rank_mape")),
        _pct(r.get("sigma")),
        _num(r.get("median_ratio")),
        _num(r.get("plan_max_spearman")),
        _pct(r.get("plan_max_mape")),
    ]
    table.add_row(label, *([str(r.get("ranks", 0))] if ranks else []), *cells)


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
            help=f"{BATCH_PER_RANK_HELP}; every kernel is timed at this × --gpus (the "
            "job's global batch), as plans are priced and measured.",
        ),
    ] = 128,
    minutes: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Budget for all phases: anchors (≤ 40 %), plan ranks, fit (5 %, ≥ 8 s). "
            "About 10 judge 100 heavy tables on 8 GPUs on 2 CPU cores; a run too short to "
            "judge plan ranks says how long it needs.",
        ),
    ] = 10.0,
    gpu_memory: Annotated[
        str | None,
        typer.Option(
            help="Memory of one of the job's GPUs, e.g. 16GiB: candidate plans then fill "
            "ranks as the job's will.",
            show_default="sized so plans fill GPUs to 75 %",
        ),
    ] = None,
    base_model: Annotated[
        Path | None,
        typer.Option(
            "--base-model",
            help="Model to calibrate.",
            show_default="this machine's cached model for these tables, else the bundled one",
        ),
    ] = None,
    base_name: Annotated[
        str | None,
        typer.Option(
            "--base-name",
            help="How the calibrated model names the model it started from (its "
            "calibration's base), e.g. the published model --base-model is a copy of.",
            show_default="--base-model's path, else the cache's choice",
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
        typer.Option("--max-samples", hidden=True, min=1, help="Cap on plan ranks."),
    ] = None,
    anchor_samples: Annotated[
        int | None,
        typer.Option("--anchor-samples", hidden=True, min=1, help="Cap on anchors."),
    ] = None,
    tiny: Annotated[
        bool, typer.Option("--tiny", hidden=True, help="Small networks from scratch (tests).")
    ] = False,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
) -> None:
    """Calibrate a cost model on this machine for the job's tables.

    Times every job table alone at the job's global batch (--batch-per-rank x --gpus),
    heaviest first (its anchors), with the kernel's own overhead, the heaviest tables'
    first row ranges and the smallest tables' data-parallel copies, then the ranks of
    candidate plans for the job (the greedy heuristics', TorchRec's, NeuroShard's,
    random ones, column halves, row-wise and data-parallel draws), every kernel of a
    rank: what a search asks a model about; halfway, every anchor once more. It fits
    how a rank costs other than its parts on the training tables' ranks and judges the
    model on held-out tables' ranks: per-rank and plan-max Spearman, MAPE and the error
    spread, overall and per kind, with a verdict you can act on.
    All within --minutes. Writes the model to this machine's model cache, where
    `shardwise plan`, `evaluate` and `bench` pick it up, and to --out when given; the
    samples go to --work-dir. Ctrl-C keeps every sample: the same command resumes.

    Example: shardwise calibrate --tables tables.yaml --gpus 8 --batch-per-rank 1024
    --gpu-memory 16GiB
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
    memory = parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    job = Job(tuple(load_tables(tables_path)), gpus, batch_per_rank, seed, memory)
    fingerprint = current_fingerprint(measure_on)
    base, chosen = _base_model(base_model, fingerprint.key(), job)
    work = work_dir or default_work_dir(cache_root(), fingerprint, job)
    try:
        with progress() as bar:
            task = bar.add_task("calibrating", total=int(budget.total_s))

            def on_progress(p: PhaseProgress) -> None:
                bar.update(task, completed=min(p.elapsed_s, p.budget_s), description=p.text)

            result = calibrate(
                job,
                base,
                base_name or chosen,
                work,
                budget,
                from_scratch=from_scratch,
                device=measure_on,
                max_samples=max_samples,
                tiny=tiny,
                anchor_samples=anchor_samples,
                on_progress=on_progress,
            )
    except KeyboardInterrupt:
        err.print(
            f"interrupted: every measured sample is kept in {work}. To resume (it measures "
            "only what is missing, then fits), run the same command again:\n"
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
