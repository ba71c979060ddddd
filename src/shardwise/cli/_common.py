"""Shared pieces of the CLI: the consoles, the progress bar and cost-model helpers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

# Piped output (logs, CI, `make demo | tee`) gets room for the wide tables.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


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
