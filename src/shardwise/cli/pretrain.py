"""`shardwise pretrain`: train the cost models on measured costs, or report on one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from shardwise.basics import UserError, check_output_path
from shardwise.cli._common import (
    check_plot_path,
    err,
    load_model,
    model_option,
    out,
    progress,
    wrote_then_failed,
)


def pretrain_cmd(
    dataset: Annotated[
        Path | None,
        typer.Argument(
            help="Directory holding compute/ (and comm/) cost datasets from `shardwise profile`."
        ),
    ] = None,
    out_path: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the cost model.")
    ] = Path("model.pt"),
    plot: Annotated[
        Path | None,
        typer.Option(
            help="Also draw the test split's predicted-vs-measured scatter as a PNG here."
        ),
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
    model_path: Annotated[Path | None, model_option("for --report")] = None,
    tiny: Annotated[
        bool,
        typer.Option("--tiny", hidden=True, help="Small networks: tests the pipeline in seconds."),
    ] = False,
) -> None:
    """Pre-train the compute and communication cost models on measured costs.

    Splits compute samples by table (test tables never seen in training), stops early
    on validation loss, and reports MAPE, R² and Spearman on the test split; the shipped
    compute network is then trained again on every sample (judge it on tables it never
    saw: `make pretrain` measures a held-out family). Writes the model to --out (and,
    with --plot, a PNG); --report writes no file.

    Example: shardwise pretrain datasets/cpu --out model.pt --plot scatter.png
    """
    import json

    if report:
        model = load_model(model_path)
        _say_where_measured(model)
        out.print_json(
            json.dumps(
                {k: model.metadata[k] for k in ("metrics", "fingerprint") if k in model.metadata}
            )
        )
        return
    if dataset is None:
        raise UserError("give the dataset directory (e.g. datasets/cpu), or --report.")
    # Before training: a bad path must not cost the minutes it takes.
    check_output_path(out_path, "--out", "model.pt")
    check_plot_path(plot)
    from shardwise.profiler.pretrain import EpochProgress, pretrain

    with progress() as bar:
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
        try:
            rep.scatter_png(plot)
        except (OSError, ValueError) as e:
            raise wrote_then_failed(out_path, plot, "--plot", e) from None
        out.print(f"wrote {plot}")


def _say_where_measured(model: Any) -> None:
    """A report's metrics are true of the machine the model was measured on: say when
    that is not this one, and how to get a model that holds here."""
    from shardwise.profiler.fingerprint import Fingerprint, current_fingerprint

    measured = Fingerprint.from_dict(model.metadata["fingerprint"])
    here = current_fingerprint()
    if not measured.matches(here):
        err.print(
            f"note: {model.source} was measured on {measured.describe()}, not on this "
            f"machine ({here.describe()}): its metrics are that machine's. "
            "`shardwise calibrate --tables T.yaml` fits a model to this one."
        )
