"""The ``shardwise`` command line: thin wrappers over the library, with clear errors.

Every mistake a user can make ends as a one-paragraph message and exit code 2
(:class:`~shardwise.planner.errors.UserError`); a traceback means a bug.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardwise import __version__
from shardwise.planner.base import PlannerOptions
from shardwise.planner.errors import UserError
from shardwise.planner.plan import DEFAULT_MEMORY_RESERVE, Plan, Topology, save_plan
from shardwise.planner.registry import get_planner, planner_names
from shardwise.planner.report import PlanSummary, plot_plan, rank_loads, summarize
from shardwise.planner.tables import TableSpec, load_tables, save_tables
from shardwise.planner.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from shardwise.profiler.runner import RunSummary

DEFAULT_PLANNER = "size-lookup-greedy"

app = typer.Typer(
    help=(
        "Shardwise places DLRM embedding tables on GPUs so that no GPU is the straggler.\n\n"
        "Typical flow: `shardwise tables generate` (or `tables from-trace`) writes table "
        "specs; `shardwise plan` turns them into a plan.json that TorchRec's "
        "DistributedModelParallel reads; `shardwise evaluate` measures a plan for real.\n\n"
        "Cost models: `shardwise profile compute|comm` measures FBGEMM kernels and "
        "all-to-alls into datasets, `shardwise pretrain` trains the models that price "
        "plans (a pre-trained CPU model ships in the package)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tables_app = typer.Typer(
    help="Make table specs: synthetic (calibrated to Meta's open DLRM data) or from a trace.",
    no_args_is_help=True,
)
app.add_typer(tables_app, name="tables")
profile_app = typer.Typer(
    help="Measure real embedding-kernel (FBGEMM) and all-to-all costs into a cost dataset "
    "that cost models train on. Interrupted runs resume; no finished sample is lost.",
    no_args_is_help=True,
)
app.add_typer(profile_app, name="profile")

# Piped output (logs, CI, `make demo | tee`) gets room for the wide tables.
out = Console(width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        out.print(f"shardwise {__version__}")
        raise typer.Exit()


# --------------------------------------------------------------------------- tables


@tables_app.command("generate")
def tables_generate(
    out_path: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the specs (.yaml, .json, .csv).")
    ],
    count: Annotated[int, typer.Option(min=1, help="How many tables.")] = 80,
    seed: Annotated[int, typer.Option(help="Same seed, same tables and streams.")] = 0,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Batch size at which access histograms are measured.")
    ] = 65536,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Also write the index/offset stream of one batch here (gzip'd torch file, "
            "the layout of Meta's open DLRM dataset)."
        ),
    ] = None,
) -> None:
    """Generate synthetic DLRM-like tables, calibrated to Meta's open DLRM statistics.

    Rows, widths, pooling factors (with empty samples) and Zipf-like skew are drawn
    per table; each table's access histogram is measured on a generated batch.

    Example: shardwise tables generate --count 80 --seed 1 --out tables.yaml
    """
    from shardwise.planner import synthetic
    from shardwise.planner.trace import save_trace

    with _progress() as bar:
        task = bar.add_task(f"measuring {count} tables at batch {batch_size}", total=count)
        specs = synthetic.generate_tables(
            count, seed, batch_size=batch_size, on_table=lambda: bar.advance(task)
        )
    save_tables(specs, out_path)
    total = sum(t.size_bytes for t in specs)
    out.print(f"wrote {len(specs)} tables ({format_bytes(total)} of embeddings) to {out_path}")
    if trace is not None:
        params = synthetic.draw_params(count, seed)
        save_trace(synthetic.generate_trace(params, batch_size, seed), trace)
        out.print(f"wrote one batch of {batch_size} samples to {trace}")


@tables_app.command("from-trace")
def tables_from_trace(
    trace_path: Annotated[
        Path,
        typer.Argument(
            help="gzip'd torch file with indices, offsets, lengths (Meta's open DLRM layout)."
        ),
    ],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the specs.")],
    dim: Annotated[
        int,
        typer.Option(help="Embedding width for every table (the trace has none); a multiple of 4."),
    ] = 64,
    prefix: Annotated[str, typer.Option(help="Table names are PREFIX0, PREFIX1, …")] = "t",
    dtype: Annotated[str, typer.Option(help="fp32 or fp16.")] = "fp32",
) -> None:
    """Derive table specs (pooling factor, access histogram, rows) from a real trace.

    Rows are taken as the largest index seen + 1, since a trace has no hash sizes.

    Example: shardwise tables from-trace fbgemm_t856_bs65536.pt.gz --out tables.yaml
    """
    from shardwise.planner.trace import load_trace, specs_from_trace

    trace = load_trace(trace_path)
    names = [f"{prefix}{i}" for i in range(trace.num_tables)]
    specs = specs_from_trace(trace, names=names, dims=dim, dtype=dtype)
    save_tables(specs, out_path)
    out.print(
        f"wrote {len(specs)} tables from {trace_path} (batch {trace.batch_size}) to {out_path}"
    )


# --------------------------------------------------------------------------- plan


def _rank_table(plan: Plan, tables: list[TableSpec]) -> Table:
    has_cost = plan.predicted is not None
    t = Table(
        title=f"{plan.planner}: {len(plan.tables)} tables on {plan.world_size} GPUs, "
        f"plan {plan.hash[:8]}"
    )
    for col in ("rank", "tables", "split", "memory", "mem %", "width", "lookups/sample"):
        t.add_column(col, justify="right")
    if has_cost:
        t.add_column("predicted ms", justify="right")
    cap = plan.topology.usable_bytes
    for r in rank_loads(plan, tables):
        row = [
            str(r.rank),
            str(r.tables),
            str(r.shards),
            format_bytes(r.memory_bytes),
            f"{100 * r.memory_bytes / cap:.0f}%",
            str(r.width),
            f"{r.lookups:,.0f}",
        ]
        if has_cost:
            row.append(f"{1e3 * (r.predicted_seconds or 0.0):.3f}")
        t.add_row(*row)
    return t


def _compare_table(rows: list[PlanSummary], failures: dict[str, str]) -> Table:
    priced = bool(rows) and all(r.predicted_max_seconds is not None for r in rows)

    def score(r: PlanSummary) -> float:
        return (r.predicted_max_seconds or 0.0) if priced else r.max_lookups

    best = min((score(r) for r in rows), default=0.0)
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Planners side by side, worst rank of each (lower is better)",
        caption="predicted = the cost model's max-rank embedding cost (CPU model, 128 "
        "samples per rank); measure with `shardwise evaluate`"
        if priced
        else "lookups = cols x pooling per sample: a cost proxy (no cost model)",
    )
    t.add_column("planner", no_wrap=True)
    cols = ("predicted ms", "vs best") if priced else ("lookups", "vs best")
    for col in (*cols, "imbal.", "width", "memory", "split", "plan s"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in sorted(rows, key=score):
        t.add_row(
            r.planner,
            f"{1e3 * score(r):.2f}" if priced else f"{r.max_lookups:,.0f}",
            f"{score(r) / best:.2f}x" if best else "-",
            f"{(r.predicted_imbalance if priced else r.lookup_imbalance):.2f}",
            str(r.max_width),
            format_bytes(r.max_memory_bytes),
            str(r.column_wise_tables),
            f"{r.planning_seconds:.2f}",
        )
    for name, why in failures.items():
        t.add_row(name, f"[red]failed: {why}[/red]")
    return t


def _predictor(model_path: Path | None) -> Any:
    """A cost predictor, or None (with a note) when no model is at hand."""
    from shardwise.planner.costmodel import BUNDLED_MODEL, CostPredictor

    if model_path is None and not BUNDLED_MODEL.exists():
        err.print("note: no bundled cost model in this install; plans are not priced.")
        return None
    return CostPredictor(_load_model(model_path))


@app.command("plan")
def plan_cmd(
    tables_path: Annotated[Path, typer.Argument(help="Table specs (.yaml, .json or .csv).")],
    gpus: Annotated[int, typer.Option(min=1, help="Number of GPUs (ranks).")] = 8,
    gpu_memory: Annotated[
        str, typer.Option(help="Memory per GPU, e.g. 16GiB, 80GB, 17179869184.")
    ] = "16GiB",
    planner: Annotated[
        str, typer.Option(help=f"One of: {', '.join(planner_names())}.")
    ] = DEFAULT_PLANNER,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write plan.json.")] = Path(
        "plan.json"
    ),
    plot: Annotated[
        Path | None, typer.Option(help="Also draw per-rank memory and load as a PNG here.")
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Plan with every planner and print them side by side; "
            "--out gets the --planner's plan.",
        ),
    ] = False,
    reserve: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.95,
            help="Share of each GPU's memory kept free for optimizer state, "
            "buffers and activations.",
        ),
    ] = DEFAULT_MEMORY_RESERVE,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size per rank.")] = 65536,
    device: Annotated[str, typer.Option(help="cuda, or cpu for CPU-only training.")] = "cuda",
    seed: Annotated[int, typer.Option(help="Seed for planners that draw (random).")] = 0,
    predict: Annotated[
        bool,
        typer.Option(
            "--predict/--no-predict",
            help="Price every plan with the cost model (the bundled "
            "CPU model unless --model) at the evaluator's batch.",
        ),
    ] = True,
    model_path: Annotated[
        Path | None, typer.Option("--model", help="Cost model for the predictions.")
    ] = None,
) -> None:
    """Place the tables on GPUs and write plan.json (design §5).

    Prints one row per GPU: tables, column-wise splits, memory, summed width and
    lookups per sample (and predicted cost for planners with a cost model).

    Example: shardwise plan tables.yaml --gpus 8 --gpu-memory 4GiB
    --planner size-lookup-greedy --out plan.json --plot plan.png
    """
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device must be cuda or cpu, not {device!r}.")
    topology = Topology(
        gpus=gpus,
        gpu_memory_bytes=parse_bytes(gpu_memory, "--gpu-memory"),
        device=device,
        batch_size_per_rank=batch_size,
        memory_reserve=reserve,
    )
    options = PlannerOptions(seed=seed)
    # Planners are built (and their modules imported) before any timing starts.
    planners = {planner: get_planner(planner, options)}  # an unknown name fails here
    if compare:
        planners.update((n, get_planner(n, options)) for n in planner_names() if n != planner)
    tables = load_tables(tables_path)
    predictor = _predictor(model_path) if predict else None
    plans: dict[str, Plan] = {}
    summaries: list[PlanSummary] = []
    failures: dict[str, str] = {}
    for name, chosen in planners.items():
        start = time.perf_counter()
        try:
            p = chosen.plan(tables, topology)
        except UserError as e:
            if name == planner:
                raise
            failures[name] = str(e).split(";")[0]
            continue
        elapsed = time.perf_counter() - start
        p.validate_plan(tables, source=f"the {name} planner's plan")
        if predictor is not None and p.predicted is None:
            p = p.model_copy(update={"predicted": predictor.predict_plan(p, tables).predicted()})
        plans[name] = p
        summaries.append(summarize(p, tables, elapsed))
    result = plans[planner]
    out.print(_rank_table(result, tables))
    if compare:
        out.print(_compare_table(summaries, failures))
    save_plan(result, out_path)
    out.print(f"wrote {out_path} (planner {planner}, hash {result.hash[:8]})")
    if plot is not None:
        plot_plan(result, tables, plot)
        out.print(f"wrote {plot}")


# --------------------------------------------------------------------------- profile


def _cv_summary(cvs: list[float]) -> str:
    if not cvs:
        return "no new samples"
    ordered = sorted(cvs)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"CV median {100 * statistics.median(ordered):.1f}%, p90 {100 * p90:.1f}%"


def _publish(out_dir: Path, target: str | None, job: str) -> None:
    if target is None:
        return
    from shardwise.profiler.dataset import CostDataset
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
    """Progress bar, the run, its summary line, and the optional publishing."""
    _check_publish_target(publish_to)
    start = time.perf_counter()
    with _progress() as bar:
        task = bar.add_task(f"{what} samples", total=samples)
        summary = run(lambda _: bar.advance(task))
        bar.update(task, completed=samples)
    out.print(
        f"{summary.total} {what} samples in {out_dir} ({summary.measured} measured now, "
        f"{summary.skipped} resumed) in {time.perf_counter() - start:.0f} s; "
        f"{_cv_summary(summary.cvs)}"
    )
    _publish(out_dir, publish_to, job)


@profile_app.command("compute")
def profile_compute_cmd(
    tables_path: Annotated[Path, typer.Option("--tables", help="Table specs to sample from.")],
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Dataset directory (created or resumed).")
    ],
    samples: Annotated[int, typer.Option(min=1, help="Samples in the dataset when done.")] = 200,
    seed: Annotated[int, typer.Option(help="Sample i is the same task for a given seed.")] = 0,
    batch_size: Annotated[
        list[int] | None,
        typer.Option(
            "--batch-size",
            min=1,
            help="Global batch per kernel call; repeat the option to "
            "cycle through several [default: 256, 512, 1024, 2048].",
        ),
    ] = None,
    max_tables: Annotated[int, typer.Option(min=1, help="Tables per sample, at most.")] = 15,
    memory_cap: Annotated[str, typer.Option(help="Weights per sample, at most.")] = "2GiB",
    fp16_share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of samples with fp16 weights.")
    ] = 0.0,
    device: Annotated[
        str | None, typer.Option(help="cuda or cpu (default: cuda if present).")
    ] = None,
    publish_to: PublishOpt = None,
    job: JobOpt = "standalone",
    allow_mismatch: MismatchOpt = False,
) -> None:
    """Time fused FBGEMM kernels over samples of 1..15 augmented tables.

    Every table is tried at widths 4..128 (NeuroShard's augmentation); each sample is
    one fused SplitTableBatchedEmbeddingBagsCodegen, forward + backward with its fused
    optimizer: 5 warm-ups, median of 10, CV recorded.

    Example: shardwise profile compute --tables tables.yaml --samples 200 --out costs/compute
    """
    from shardwise.profiler.runner import DEFAULT_COMPUTE_BATCHES, profile_compute

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
            batch_sizes=batch_size or DEFAULT_COMPUTE_BATCHES,
            max_tables=max_tables,
            memory_cap_bytes=parse_bytes(memory_cap, "--memory-cap"),
            fp16_share=fp16_share,
            device=device,
            allow_mismatch=allow_mismatch,
            on_sample=on_sample,
        ),
    )


@profile_app.command("comm")
def profile_comm_cmd(
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Dataset directory (created or resumed).")
    ],
    world_size: Annotated[
        list[int] | None,
        typer.Option(
            "--world-size",
            min=2,
            help="World sizes to sample; repeat the option [default: 2, 4, 8].",
        ),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Samples in the dataset when done.")] = 60,
    seed: Annotated[int, typer.Option(help="Sample i is the same task for a given seed.")] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch per rank.")] = 128,
    publish_to: PublishOpt = None,
    job: JobOpt = "standalone",
    allow_mismatch: MismatchOpt = False,
) -> None:
    """Time real all-to-alls with random per-rank widths and start delays.

    gloo on CPU, nccl on GPUs; the delays model the forward's straggler wait, and the
    forward and backward collectives are timed apart.

    Example: shardwise profile comm --world-size 2 --world-size 4 --samples 60 --out costs/comm
    """
    from shardwise.profiler.runner import profile_comm

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
            on_sample=on_sample,
        ),
    )


# --------------------------------------------------------------------------- evaluate


def _cost_table(title: str, doc: dict[str, Any]) -> Table:
    """Per-rank costs from the JSON shape shared by measured and predicted evaluations."""
    t = Table(title=title)
    for col in ("rank", "fwd compute", "bwd compute", "fwd a2a", "bwd a2a", "total"):
        t.add_column(col + ("" if col == "rank" else " ms"), justify="right")
    for r in doc["ranks"]:
        keys = ("fwd_compute_s", "bwd_compute_s", "fwd_comm_s", "bwd_comm_s", "total_s")
        t.add_row(str(r["rank"]), *(f"{1e3 * r[k]:.2f}" for k in keys))
    return t


def _load_model(path: Path | None) -> Any:
    """The cost model at ``path`` (or the bundled one), with a word if the device differs."""
    from shardwise.planner.costmodel import CostModel, load_bundled
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


@app.command("evaluate")
def evaluate_cmd(
    plan_path: Annotated[Path, typer.Argument(help="plan.json from any planner.")],
    tables_path: Annotated[Path, typer.Option("--tables", help="The plan's table specs.")],
    predict: Annotated[
        bool,
        typer.Option(
            "--predict",
            help="Print the cost model's prediction (no measurement unless "
            "--measure is also given).",
        ),
    ] = False,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Measure (the default without --predict); with --predict, "
            "print both and the prediction's error.",
        ),
    ] = False,
    model_path: Annotated[
        Path | None,
        typer.Option("--model", help="Cost model for --predict [default: the bundled CPU model]."),
    ] = None,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Batch per rank (compute runs at batch x world size).")
    ] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Whole measurements to repeat.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    device: Annotated[
        str | None, typer.Option(help="cuda or cpu (default: cuda if present).")
    ] = None,
) -> None:
    """Measure (or predict) a plan's embedding cost per rank.

    Measuring runs each rank's fused kernel (one rank at a time, exactly its shards)
    and a real all-to-all with the plan's per-rank widths; --predict asks the cost
    model instead, and --predict --measure prints both and the prediction's error.

    Example: shardwise evaluate plan.json --tables tables.yaml --predict --measure
    """
    import json

    from shardwise.planner.plan import load_plan

    plan = load_plan(plan_path)
    tables = load_tables(tables_path)
    plan.validate_plan(tables, source=str(plan_path))
    docs: dict[str, dict[str, Any]] = {}
    if predict:
        from shardwise.planner.costmodel import CostPredictor

        prediction = CostPredictor(_load_model(model_path)).predict_plan(
            plan, tables, batch_size_per_rank=batch_size
        )
        docs["predicted"] = prediction.to_json()
    if measure or not predict:
        from shardwise.profiler.evaluate import evaluate_plan

        with _progress() as bar:
            task = bar.add_task("measuring", total=None)
            result = evaluate_plan(
                plan,
                tables,
                batch_size_per_rank=batch_size,
                repeats=repeats,
                device=device,
                on_step=lambda what: bar.update(task, description=what),
            )
        docs["measured"] = result.to_json()
    if len(docs) == 2:
        pred, meas = docs["predicted"], docs["measured"]
        docs["error"] = {
            "max_s": pred["max_s"] / meas["max_s"] - 1.0,
            "per_rank_total": [
                p["total_s"] / m["total_s"] - 1.0 if m["total_s"] else 0.0
                for p, m in zip(pred["ranks"], meas["ranks"], strict=True)
            ],
        }
    if as_json:
        print(json.dumps(docs if len(docs) > 1 else next(iter(docs.values())), indent=1))
        return
    head = f"{plan.planner} plan {plan.hash[:8]}, batch {batch_size}/rank"
    if "predicted" in docs:
        d = docs["predicted"]
        out.print(_cost_table(f"{head}: predicted by the cost model", d))
        out.print(
            f"predicted max {1e3 * d['max_s']:.2f} ms, imbalance (max/mean) "
            f"{d['imbalance_max_over_mean']:.2f}"
        )
    if "measured" in docs:
        d = docs["measured"]
        out.print(_cost_table(f"{head}: measured on {d['device']}, median of {repeats}", d))
        out.print(
            f"max {1e3 * d['max_s']:.2f} ms, imbalance (max/mean) "
            f"{d['imbalance_max_over_mean']:.2f}, repeatability: CV of the max over "
            f"{repeats} repeats {100 * d['repeat_cv']:.1f}%"
            + ("" if d["allocator_mitigated"] else "; WARNING: allocator mitigation inactive")
        )
        if str(d["device"]).startswith("cpu"):
            out.print("These are CPU figures (FBGEMM CPU kernels, gloo all-to-all).")
    if "error" in docs:
        e = docs["error"]
        worst = max(abs(x) for x in e["per_rank_total"])
        out.print(
            f"prediction error: max-rank cost {100 * e['max_s']:+.1f}%, "
            f"worst rank {100 * worst:.1f}%"
        )


# --------------------------------------------------------------------------- pretrain


@app.command("pretrain")
def pretrain_cmd(
    dataset: Annotated[
        Path | None,
        typer.Argument(
            help="Directory holding compute/ (and comm/) cost datasets from `shardwise profile`."
        ),
    ] = None,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the model.")] = Path(
        "model.pt"
    ),
    plot: Annotated[
        Path | None, typer.Option(help="Predicted-vs-measured scatter PNG of the test split.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Split and initialisation seed.")] = 0,
    holdout_world_size: Annotated[
        int | None,
        typer.Option(
            help="World size kept out of comm training, to show generalisation (0: none)."
        ),
    ] = 8,
    report: Annotated[
        bool,
        typer.Option(
            "--report",
            help="Print the test-split metrics of an existing model (--model, "
            "default: the bundled one) instead of training.",
        ),
    ] = False,
    model_path: Annotated[Path | None, typer.Option("--model", help="Model for --report.")] = None,
    tiny: Annotated[
        bool,
        typer.Option("--tiny", hidden=True, help="Small networks: tests the pipeline in seconds."),
    ] = False,
) -> None:
    """Pre-train the compute and communication cost models on measured costs.

    Splits compute samples by table (test tables never seen in training), stops early
    on validation loss, and reports MAPE, R² and Spearman on the test split.

    Example: shardwise pretrain datasets/cpu --out model.pt --plot scatter.png
    """
    import json

    if report:
        model = _load_model(model_path)
        out.print_json(
            json.dumps(
                {k: model.metadata[k] for k in ("metrics", "fingerprint") if k in model.metadata}
            )
        )
        return
    if dataset is None:
        raise UserError("give the dataset directory (e.g. datasets/cpu), or --report.")
    from shardwise.profiler.pretrain import EpochProgress, pretrain

    with _progress() as bar:
        task = bar.add_task("training", total=None)

        def on_epoch(p: EpochProgress) -> None:
            bar.update(
                task,
                description=f"{p.model}: epoch {p.epoch}/{p.max_epochs}, validation loss "
                f"{p.val_loss:.4f} (best {p.best_val_loss:.4f})",
            )

        model, rep = pretrain(
            dataset,
            seed=seed,
            holdout_world_size=holdout_world_size or None,
            on_epoch=on_epoch,
            tiny=tiny,
        )
    model.save(out_path)
    out.print(rep.format())
    out.print(f"wrote {out_path}")
    if plot is not None:
        rep.scatter_png(plot)
        out.print(f"wrote {plot}")


def main() -> None:
    """Entry point: user mistakes become a message and exit code 2, never a traceback."""
    try:
        app()
    except UserError as e:
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
