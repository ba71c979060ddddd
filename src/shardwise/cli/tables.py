"""`shardwise tables`: make table specs (generate, from-trace)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shardwise.basics import UserError, check_output_path, format_bytes
from shardwise.cli._common import TABLES_OUT_HELP, deprecated, out, progress, renamed
from shardwise.planner.tables import format_of, load_tables, save_tables


def _check_tables_out(path: Path) -> None:
    """Before any work: ``--out`` names a tables format and a writable place."""
    check_output_path(path, "--out", "tables.yaml")
    format_of(path)


tables_app = typer.Typer(
    help="Make table specs: synthetic (calibrated to Meta's open DLRM data, or the broad "
    "and held-out families), from a trace, or merged from other files; each command "
    "writes a tables file (.yaml, .json or .csv) to --out.",
    no_args_is_help=True,
)


@tables_app.command("generate")
def tables_generate(
    ctx: typer.Context,
    out_path: Annotated[Path, typer.Option("--out", "-o", help=TABLES_OUT_HELP)],
    count: Annotated[int, typer.Option(min=1, help="How many tables.")] = 80,
    seed: Annotated[int, typer.Option(help="Same seed, same tables and streams.")] = 0,
    family: Annotated[
        str,
        typer.Option(
            help="calibrated (Meta's open DLRM statistics), broad (rows 1e2-1e8, widths "
            "4-256, pooling 1-200, uniform to heavy Zipf, fp32/fp16: for pre-training), "
            "heldout (built another way, to judge a model on; seed 2027 is the committed "
            "set), heavy (tables up to 1 GiB, pooling up to 100: to benchmark big "
            "plans on) or industrial (a few giant tables among many small ones, for "
            "plans where some tables fit no GPU whole). See docs/design.md §7."
        ),
    ] = "calibrated",
    histogram_batch: Annotated[
        int,
        typer.Option(
            min=1,
            help="Samples in the generated batch on which each table's pooling factor and "
            "access histogram are measured (a histogram depends on it).",
        ),
    ] = 65536,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Also write the index/offset stream of that batch here (gzip'd torch file, "
            "the layout of Meta's open DLRM dataset)."
        ),
    ] = None,
    old_batch_size: Annotated[
        int | None, deprecated("--batch-size", "--histogram-batch", min=1)
    ] = None,
) -> None:
    """Generate synthetic DLRM-like tables (by default calibrated to Meta's open DLRM
    statistics; --family picks another distribution).

    Rows, widths, pooling factors (with empty samples) and skew are drawn per table;
    each table's access histogram is measured on a generated batch.
    Writes the specs to --out (and, with --trace, that batch's stream).

    Example: shardwise tables generate --count 80 --seed 1 --out tables.yaml
    """
    from shardwise.planner import families, synthetic
    from shardwise.planner.trace import save_trace

    batch_size = renamed(ctx, "histogram_batch", histogram_batch, old_batch_size)
    if family not in families.FAMILIES:
        raise UserError(
            f"--family {family!r} is not a table family; use one of {', '.join(families.FAMILIES)}."
        )
    _check_tables_out(out_path)
    if trace is not None:
        if family != "calibrated":
            raise UserError(f"--trace is written for --family calibrated only, not {family}.")
        check_output_path(trace, "--trace", "trace.pt.gz")

    with progress() as bar:
        task = bar.add_task(f"measuring {count} tables at batch {batch_size}", total=count)
        specs = families.generate(
            family, count, seed, batch_size=batch_size, on_table=lambda: bar.advance(task)
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
    out_path: Annotated[Path, typer.Option("--out", "-o", help=TABLES_OUT_HELP)],
    dim: Annotated[
        int,
        typer.Option(help="Embedding width for every table (the trace has none); a multiple of 4."),
    ] = 64,
    prefix: Annotated[str, typer.Option(help="Table names are PREFIX0, PREFIX1, …")] = "t",
    dtype: Annotated[str, typer.Option(help="fp32 or fp16.")] = "fp32",
) -> None:
    """Derive table specs (pooling factor, access histogram, rows) from a real trace.

    Rows are taken as the largest index seen + 1, since a trace has no hash sizes.
    Writes the specs to --out.

    Example: shardwise tables from-trace fbgemm_t856_bs65536.pt.gz --out tables.yaml
    """
    from shardwise.planner.trace import load_trace, specs_from_trace

    _check_tables_out(out_path)
    trace = load_trace(trace_path)
    names = [f"{prefix}{i}" for i in range(trace.num_tables)]
    specs = specs_from_trace(trace, names=names, dims=dim, dtype=dtype)
    save_tables(specs, out_path)
    out.print(
        f"wrote {len(specs)} tables from {trace_path} (batch {trace.batch_size}) to {out_path}"
    )


@tables_app.command("merge")
def tables_merge(
    inputs: Annotated[
        list[Path], typer.Argument(help="Tables files (.yaml, .json or .csv) to merge, in order.")
    ],
    out_path: Annotated[Path, typer.Option("--out", "-o", help=TABLES_OUT_HELP)],
    max_pooling: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Keep only tables with at most this many lookups per sample (the light "
            "tables a large profiling batch is paired with).",
        ),
    ] = None,
) -> None:
    """Merge tables files into one pool (names must be unique across the files).

    Writes the merged specs to --out.

    Example: shardwise tables merge calibrated.yaml broad.yaml --max-pooling 4 --out light.yaml
    """
    from shardwise.planner.families import merge_pools

    _check_tables_out(out_path)
    pools = [load_tables(p) for p in inputs]
    merged = merge_pools(pools, max_pooling)
    save_tables(merged, out_path)
    kept = (
        f", {len(merged)} with pooling factor <= {max_pooling}" if max_pooling is not None else ""
    )
    out.print(
        f"merged {sum(len(p) for p in pools)} tables from {len(inputs)} files{kept}; "
        f"wrote {len(merged)} to {out_path}"
    )
