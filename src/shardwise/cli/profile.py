"""`shardwise profile compute|comm`: measure cost datasets, and publish them."""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shardwise.basics import UserError, parse_bytes
from shardwise.cli._common import (
    BATCH_PER_RANK_HELP,
    DATASET_OUT_HELP,
    GLOBAL_BATCH_HELP,
    SAMPLES_HELP,
    TABLES_HELP,
    MeasureOnOpt,
    deprecated,
    err,
    out,
    progress,
    renamed,
)
from shardwise.planner.tables import load_tables

if TYPE_CHECKING:
    from shardwise.profiler.collect import RunSummary

SEED_HELP = "Sample i is the same task for a given seed."

profile_app = typer.Typer(
    help="Measure real embedding-kernel (FBGEMM) and all-to-all costs into a cost dataset "
    "(a directory, --out) that cost models train on. Interrupted runs resume; no finished "
    "sample is lost. A dataset whose dataset.json was lost is rebuilt from its records by "
    "the same command with --repair.",
    no_args_is_help=True,
)


def _cv_summary(cvs: list[float]) -> str:
    if not cvs:
        return "no new samples"
    ordered = sorted(cvs)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"CV median {100 * statistics.median(ordered):.1f}%, p90 {100 * p90:.1f}%"


def _publish(out_dir: Path, target: str | None, job: str) -> None:
    if target is None:
        return
    from shardwise.profiler.dataset.store import CostDataset
    from shardwise.profiler.publish import core_v1_api, parse_target, publish

    namespace, name = parse_target(target)
    key = CostDataset.open(out_dir).fingerprint.key()
    names = publish(
        out_dir,
        name,
        namespace,
        core_v1_api(),
        job=job,
        component="profiler",
        fingerprint_key=key,
        filename=out_dir.name,
    )
    out.print(f"published {out_dir} as ConfigMap(s) {', '.join(names)} in {namespace}")


PublishOpt = Annotated[
    str | None,
    typer.Option(
        "--publish",
        help="Also publish the dataset through the Kubernetes API as compressed "
        "ConfigMap(s) NAMESPACE/NAME (what a profiling pod does).",
    ),
]
JobOpt = Annotated[str, typer.Option(help="DLRMJob name for the published ConfigMaps' labels.")]
MismatchOpt = Annotated[
    bool,
    typer.Option(
        "--allow-mismatch",
        help="Append to a dataset measured on another device or with other "
        "settings (recorded in its manifest) instead of refusing.",
    ),
]
RepairOpt = Annotated[
    bool,
    typer.Option(
        "--repair",
        help="Rebuild a lost dataset.json from records.jsonl, then resume. Give the "
        "options of the command that measured the records (the same --tables, --seed and "
        "sampling options): every record must be the sample they draw, measured on this "
        "machine, or nothing is written and the first disagreeing lines are named. A "
        "dataset that has its dataset.json is left as it is.",
    ),
]


def _say_interrupted(what: str, out_dir: Path, measured: int) -> None:
    """Every appended sample is on disk (fsync'd): say how many, and how to go on."""
    from shardwise.profiler.dataset.store import CostDataset

    try:
        n = len(CostDataset.open(out_dir))
        kept = f"{n} {what} sample is" if n == 1 else f"{n} {what} samples are"
    except UserError:
        kept = "no sample is"  # interrupted before the dataset was created
    err.print(
        f"interrupted: {kept} on disk in {out_dir} ({measured} measured by this run); "
        "every finished sample is kept. To resume, run the same command again:\n"
        f"  shardwise {shlex.join(sys.argv[1:])}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _check_publish_target(target: str | None) -> None:
    """Fail on a malformed --publish before measuring for minutes."""
    if target is not None:
        from shardwise.profiler.publish import parse_target

        parse_target(target)


def _run_profile(
    what: str,
    samples: int,
    out_dir: Path,
    publish_to: str | None,
    job: str,
    run: Callable[[Callable[[int], None]], RunSummary],
) -> None:
    """Progress bar, the run, its summary line, and the optional publishing; on Ctrl-C,
    what was kept and how to resume."""
    _check_publish_target(publish_to)
    start = time.perf_counter()
    measured = 0
    try:
        with progress() as bar:
            task = bar.add_task(f"{what} samples", total=samples)

            def on_sample(_: int) -> None:
                nonlocal measured
                measured += 1
                bar.advance(task)

            summary = run(on_sample)
            bar.update(task, completed=samples)
    except KeyboardInterrupt:
        _say_interrupted(what, out_dir, measured)
        raise typer.Exit(130) from None
    repaired = getattr(summary, "repaired", 0)  # a summary without it repaired nothing
    if repaired:
        out.print(f"rebuilt {out_dir / 'dataset.json'} from {repaired} records")
    out.print(
        f"{summary.total} {what} samples in {out_dir} ({summary.measured} measured now, "
        f"{summary.skipped} resumed) in {time.perf_counter() - start:.0f} s; "
        f"{_cv_summary(summary.cvs)}"
    )
    _publish(out_dir, publish_to, job)


@profile_app.command("compute")
def profile_compute_cmd(
    ctx: typer.Context,
    tables_path: Annotated[Path, typer.Option("--tables", help=f"{TABLES_HELP} to sample from.")],
    out_dir: Annotated[Path, typer.Option("--out", "-o", help=DATASET_OUT_HELP)],
    samples: Annotated[int, typer.Option(min=1, help=SAMPLES_HELP)] = 200,
    seed: Annotated[int, typer.Option(help=SEED_HELP)] = 0,
    global_batch: Annotated[
        list[int] | None,
        typer.Option(
            "--global-batch",
            min=1,
            help=f"{GLOBAL_BATCH_HELP}; repeat the option to cycle through several.",
            show_default="256, 512, 1024, 2048",
        ),
    ] = None,
    max_tables: Annotated[int, typer.Option(min=1, help="Tables per sample, at most.")] = 15,
    memory_cap: Annotated[str, typer.Option(help="Weights per sample, at most.")] = "2GiB",
    fp16_share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of samples with fp16 weights.")
    ] = 0.0,
    row_wise_share: Annotated[
        float,
        typer.Option(
            "--row-wise-share",
            min=0.0,
            max=1.0,
            help="Share of samples that are one rank of a row-wise cut: range k of "
            "TorchRec's even cut over m = 2..32 ranks of every table, at the global batch.",
        ),
    ] = 0.0,
    data_parallel_share: Annotated[
        float,
        typer.Option(
            "--data-parallel-share",
            min=0.0,
            max=1.0,
            help="Share of samples that are a rank with data-parallel tables (fp32, read at "
            "the global batch over W = 2..16 ranks) beside fused ones.",
        ),
    ] = 0.0,
    measure_on: MeasureOnOpt = None,
    publish_to: PublishOpt = None,
    job: JobOpt = "standalone",
    allow_mismatch: MismatchOpt = False,
    repair: RepairOpt = False,
    old_batch_size: Annotated[
        list[int] | None, deprecated("--batch-size", "--global-batch", min=1)
    ] = None,
    old_device: Annotated[str | None, deprecated("--device", "--measure-on")] = None,
) -> None:
    """Time fused FBGEMM kernels over samples of 1..15 augmented tables.

    Every table is tried at widths 4..128 (NeuroShard's augmentation); each sample is
    one fused SplitTableBatchedEmbeddingBagsCodegen, forward + backward with its fused
    optimizer: 5 warm-ups, median of 10, CV recorded. With --row-wise-share or
    --data-parallel-share, that share of the samples is instead one rank of those kinds,
    one kernel per kind as TorchRec runs them, each kernel's time recorded. Appends each
    sample to the dataset in --out (dataset.json, records.jsonl) as it is measured;
    --publish also writes it to ConfigMaps. Ctrl-C keeps every finished sample: the same command
    resumes, and with --repair it first rebuilds a lost dataset.json.

    Example: shardwise profile compute --tables tables.yaml --samples 200 --out costs/compute
    """
    from shardwise.profiler.collect import DEFAULT_COMPUTE_BATCHES, profile_compute

    batches = renamed(ctx, "global_batch", global_batch, old_batch_size)
    device = renamed(ctx, "measure_on", measure_on, old_device)
    if row_wise_share + data_parallel_share > 1.0:
        raise UserError(
            f"--row-wise-share {row_wise_share} and --data-parallel-share "
            f"{data_parallel_share} add up to more than 1: they are shares of the same "
            "samples. Lower one of them."
        )
    tables = load_tables(tables_path)
    _run_profile(
        "compute",
        samples,
        out_dir,
        publish_to,
        job,
        lambda on_sample: profile_compute(
            tables,
            out_dir,
            samples,
            seed=seed,
            batch_sizes=batches or DEFAULT_COMPUTE_BATCHES,
            max_tables=max_tables,
            memory_cap_bytes=parse_bytes(memory_cap, "--memory-cap"),
            fp16_share=fp16_share,
            row_share=row_wise_share,
            dp_share=data_parallel_share,
            device=device,
            allow_mismatch=allow_mismatch,
            repair=repair,
            on_sample=on_sample,
        ),
    )


@profile_app.command("comm")
def profile_comm_cmd(
    ctx: typer.Context,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help=DATASET_OUT_HELP)],
    world_size: Annotated[
        list[int] | None,
        typer.Option(
            "--world-size",
            min=2,
            help="World sizes to sample; repeat the option for several.",
            show_default="2, 4, 8",
        ),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help=SAMPLES_HELP)] = 60,
    seed: Annotated[int, typer.Option(help=SEED_HELP)] = 0,
    batch_per_rank: Annotated[
        int,
        typer.Option(
            min=1, help=f"{BATCH_PER_RANK_HELP}: each rank sends this x its width to every rank."
        ),
    ] = 128,
    publish_to: PublishOpt = None,
    job: JobOpt = "standalone",
    allow_mismatch: MismatchOpt = False,
    repair: RepairOpt = False,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--batch-per-rank", min=1)
    ] = None,
) -> None:
    """Time real all-to-alls with random per-rank widths and start delays.

    gloo on CPU, nccl on GPUs; the delays model the forward's straggler wait, and the
    forward and backward collectives are timed apart. Appends each sample to the
    dataset in --out (dataset.json, records.jsonl) as it is measured; --publish also
    writes it to ConfigMaps. Ctrl-C keeps every finished sample: the same command
    resumes, and with --repair it first rebuilds a lost dataset.json.

    Example: shardwise profile comm --world-size 2 --world-size 4 --samples 60 --out costs/comm
    """
    from shardwise.profiler.collect import profile_comm

    batch_size = renamed(ctx, "batch_per_rank", batch_per_rank, old_batch_size)

    _run_profile(
        "all-to-all",
        samples,
        out_dir,
        publish_to,
        job,
        lambda on_sample: profile_comm(
            out_dir,
            samples,
            seed=seed,
            world_sizes=world_size or (2, 4, 8),
            batch_size=batch_size,
            allow_mismatch=allow_mismatch,
            repair=repair,
            on_sample=on_sample,
        ),
    )
