"""Whether a global batch lies in the range a cost model was trained or calibrated on.

The batch is a true input of the cost model (docs/design.md §7): inside the range of
global batches its samples were measured at, a prediction interpolates; outside it,
it extrapolates, and the commands say so in one line rather than silently
(docs/model-cache.md). Pure functions over the model's metadata: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _whole(values: Any) -> Iterable[int]:
    """The positive whole numbers in ``values`` (a list from a file); others skipped."""
    if not isinstance(values, list | tuple):
        return ()
    return (v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def trained_batches(metadata: Mapping[str, Any]) -> list[int]:
    """The global batches a model's compute samples were measured at, sorted: its
    pre-training's ``batch_sizes`` and its calibration's ``batch_sizes``."""
    found = set(_whole(metadata.get("batch_sizes")))
    calibration = metadata.get("calibration")
    if isinstance(calibration, Mapping):
        found.update(_whole(calibration.get("batch_sizes")))
    return sorted(found)


def _span(trained: Sequence[int]) -> str:
    lo, hi = min(trained), max(trained)
    return f"global batch {lo:,}" if lo == hi else f"global batches {lo:,}–{hi:,}"


def batch_note(
    trained: Sequence[int],
    batch: int,
    *,
    job_batch: int | None = None,
    calibrate: str | None = None,
) -> str | None:
    """One line when predictions at global ``batch`` leave the ``trained`` range, or
    when the job's own global batch (``job_batch``, where predictions are made at
    another batch, as `shardwise plan` prices at the evaluator's) does; None inside.

    ``calibrate`` is the command that would measure at ``batch``, appended when the
    predictions extrapolate.
    """
    how = f" Calibrate at this batch: `{calibrate}`." if calibrate else ""
    job = batch if job_batch is None else job_batch
    if not trained:
        return (
            "note: the cost model records no global batches it was trained on, so nothing "
            f"tells whether its predictions hold at {batch:,}.{how}"
        )
    lo, hi = min(trained), max(trained)
    head = f"note: the model was trained on {_span(trained)}"
    if not lo <= batch <= hi:
        also = f" (and so is the job's {job:,})" if job != batch and not lo <= job <= hi else ""
        return f"{head}; {batch:,} is outside{also}: predictions extrapolate.{how}"
    if not lo <= job <= hi:
        return (
            f"{head}; plans are priced at {batch:,}, inside it, but the job trains at "
            f"{job:,}, outside it: the predicted costs are for {batch:,}, not for the "
            "job's batch."
        )
    return None
