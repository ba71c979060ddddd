"""`shardwise refine-plans`: plan a job for several world sizes and refine each plan by
measurement on this machine, within one budget (what a profiling pod runs)."""

from __future__ import annotations

import hashlib
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardwise.basics import UserError, parse_bytes
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    TABLES_HELP,
    CommOpt,
    MeasureOnOpt,
    batch_check,
    calibrate_command,
    choose_model,
    err,
    measure_device,
    model_option,
    out,
    progress,
    say,
)
from shardwise.planner.topology import DEFAULT_MEMORY_RESERVE

if TYPE_CHECKING:
    from shardwise.profiler.refine.worlds import SizeResult


def refine_plans_cmd(
    tables_path: Annotated[
        Path, typer.Option("--tables", help=f"{TABLES_HELP}: the job's tables.")
    ],
    gpus: Annotated[
        list[int],
        typer.Option(
            "--gpus",
            help="A world size to refine for; repeat it. The first is the job's own: it is "
            "refined first, with half the budget.",
        ),
    ],
    gpus_per_host: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="GPUs per host (a DLRMJob's gpusPerWorker): each --gpus is that many "
            "hosts, and table-row-wise tables stay on one.",
            show_default="every world on one host",
        ),
    ] = None,
    gpu_memory: Annotated[
        str, typer.Option(help="Memory per GPU, e.g. 16GiB, 80GB, 17179869184.")
    ] = "16GiB",
    reserve: Annotated[
        float,
        typer.Option(
            min=0.0, max=0.95, help="Share of each GPU's memory kept free (docs/memory.md)."
        ),
    ] = DEFAULT_MEMORY_RESERVE,
    batch_per_rank: Annotated[
        int,
        typer.Option(
            min=1,
            help=f"{BATCH_PER_RANK_HELP} the job trains with; kernels run at this x the "
            "world size.",
        ),
    ] = 65536,
    target_device: Annotated[
        str, typer.Option(help="What the plans are for: cuda (GPUs) or cpu.")
    ] = "cuda",
    measure_on: MeasureOnOpt = None,
    seed: Annotated[int, typer.Option(min=0, help="The planner's seed (the job's).")] = 0,
    model_path: Annotated[
        Path | None, model_option("that NeuroShard plans with and refinement ranks moves by")
    ] = None,
    comm: CommOpt = "auto",
    budget: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Seconds for all sizes together, planning and measuring included (a run "
            "resumed in the same --out-dir has what the earlier one left).",
        ),
    ] = 300.0,
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out-dir",
            help="Where the plans (plan-<W>.json) and the manifest (refined.json) go; "
            "the same command given the same directory resumes.",
        ),
    ] = Path("refined"),
) -> None:
    """Plan the job with NeuroShard and refine each plan by measurement here.

    For every --gpus (the job's own size first), plans exactly as `shardwise plan`
    does and refines as its --refine measured does: each rank's fused kernel timed
    here at the job's batch (--batch-per-rank x the world size), tables moved off the
    measured straggler, the result judged by a fresh re-measurement. The job's own
    size gets half of --budget; each later size an equal part of what is left. Writes
    plan-<W>.json per refined size and refined.json (what was refined or skipped, and
    why) to --out-dir. Ctrl-C keeps what is done: the same command resumes.

    Example: shardwise refine-plans --tables tables.yaml --gpus 8 --gpus 4 --gpus 12
    --gpu-memory 80GiB --batch-per-rank 4096 --budget 300
    """
    from shardwise.planner.costmodel import CostPredictor
    from shardwise.planner.tables import load_tables
    from shardwise.profiler.fingerprint import Fingerprint, current_fingerprint
    from shardwise.profiler.refine.worlds import RefineJob, refine_plans

    if target_device not in ("cuda", "cpu"):
        raise UserError(f"--target-device must be cuda or cpu, not {target_device!r}.")
    device = measure_device(measure_on)
    job = RefineJob(
        tables=tuple(load_tables(tables_path)),
        worlds=tuple(gpus),
        gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory"),
        memory_reserve=reserve,
        batch_size_per_rank=batch_per_rank,
        target_device="cuda" if target_device == "cuda" else "cpu",
        seed=seed,
        budget_s=budget,
        comm=comm,
        gpus_per_host=gpus_per_host,
    )
    # A GPU the job runs on must be the one measuring (exit 2 on a pod without one).
    measured_on = current_fingerprint(device).describe()
    calibrate = calibrate_command(tables_path, gpus[0], batch_per_rank)
    choice = choose_model(model_path, job.tables, calibrate)
    if choice is None:
        raise UserError(
            "NeuroShard plans with a cost model and none is installed; give one with --model."
        )
    batch_check(choice, batch_per_rank * gpus[0], batch_per_rank * gpus[0], calibrate)
    predictor = CostPredictor(choice.model)
    fingerprint = (
        Fingerprint.from_dict(choice.model.fingerprint).key() if choice.model.fingerprint else ""
    )
    model_id = (
        hashlib.sha256(choice.path.read_bytes()).hexdigest()[:16]
        if choice.path is not None
        else f"{choice.origin}:{fingerprint}"
    )
    say(f"refining for {', '.join(str(w) for w in gpus)} GPUs within {budget:g} s on {measured_on}")
    try:
        with progress() as bar:
            task = bar.add_task("refining", total=None)
            result = refine_plans(
                job,
                predictor,
                out_dir,
                model_id=model_id,
                model_fingerprint=fingerprint,
                measured_on=measured_on,
                device=device,
                say=lambda line: bar.console.print(line, markup=False, highlight=False),
                on_step=lambda line: bar.update(task, description=line[:100]),
            )
    except KeyboardInterrupt:
        err.print(
            f"interrupted: what is done is kept in {out_dir}. To resume, run the same "
            f"command again:\n  shardwise {shlex.join(sys.argv[1:])}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    _report(result.out_dir, result.sizes)


def _report(out_dir: Path, sizes: Sequence[SizeResult]) -> None:
    """One line per size: the fresh re-measurement of start and final plan."""
    from shardwise.planner.plan import load_plan

    for size in sizes:
        if size.state != "refined":
            out.print(f"{size.world_size} GPUs: not refined: {size.why}", highlight=False)
            continue
        rec = load_plan(out_dir / size.file).refinement
        assert rec is not None
        start = rec.start_objective_seconds or rec.start_max_compute_seconds
        final = rec.final_objective_seconds or rec.final_max_compute_seconds
        torchrec = (
            f"; TorchRec's plan {1e3 * size.torchrec_objective_seconds:.2f} ms"
            if size.torchrec_objective_seconds is not None
            else ""
        )
        begun = f" from {rec.started_from}'s plan" if rec.started_from else ""
        out.print(
            f"{size.world_size} GPUs: {rec.moves} move(s){begun}, {rec.kernels_measured} "
            f"kernels in {rec.seconds:.1f} s; measured max {1e3 * start:.2f} -> "
            f"{1e3 * final:.2f} ms ({rec.device}){torchrec}: {out_dir / size.file}",
            highlight=False,
        )
    out.print(f"wrote {out_dir / 'refined.json'}", highlight=False)
