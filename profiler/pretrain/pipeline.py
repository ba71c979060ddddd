"""``shardwise pretrain`` end to end: datasets → both models → report and artifact."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import shardwise
from shardwise.planner.comm.learned import COLLECTIVES_KEY, collectives_metadata
from shardwise.planner.costmodel.artifact import FORMAT_VERSION, CostModel
from shardwise.planner.costmodel.networks import CommNet
from shardwise.profiler.pretrain.data import Datasets, comm_data, drift_factors, load_datasets
from shardwise.profiler.pretrain.report import PretrainReport
from shardwise.profiler.pretrain.training import (
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    EpochProgress,
    FitSettings,
    fit_collectives,
    train_comm,
    train_compute,
)


def pretrain(
    dataset_root: Path,
    *,
    seed: int = 0,
    max_epochs: int = DEFAULT_MAX_EPOCHS,
    patience: int = DEFAULT_PATIENCE,
    holdout_world_size: int | None = 8,
    on_epoch: Callable[[EpochProgress], None] | None = None,
    tiny: bool = False,
) -> tuple[CostModel, PretrainReport]:
    """Train both cost models on ``dataset_root``; see :mod:`shardwise.profiler.pretrain`.

    ``tiny`` trains small networks (for CI and tests); the split and the report are
    the same. Training runs on one thread: the networks are small, a second thread
    mostly adds synchronization, and a profiler may be measuring on the other core.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _pretrain(
            Path(dataset_root),
            seed=seed,
            max_epochs=max_epochs,
            patience=patience,
            holdout_world_size=holdout_world_size,
            on_epoch=on_epoch,
            tiny=tiny,
        )
    finally:
        torch.set_num_threads(threads)


def _pretrain(
    root: Path,
    *,
    seed: int,
    max_epochs: int,
    patience: int,
    holdout_world_size: int | None,
    on_epoch: Callable[[EpochProgress], None] | None,
    tiny: bool,
) -> tuple[CostModel, PretrainReport]:
    data = load_datasets(root)
    hidden = 16 if tiny else 64
    batch = 64 if tiny else 256
    settings = FitSettings(seed, 1e-2 if tiny else 3e-3, max_epochs, patience, on_epoch)
    notes: list[str] = []
    if drift_factors(data.compute_records) is not None:
        notes.append(
            "compute costs are normalized to the median machine speed with the reference "
            "kernel timed beside the samples"
            + (f" ({data.dropped} older samples without one were left out)" if data.dropped else "")
        )

    compute = train_compute(
        data.compute_records, str(data.compute_dir), settings, hidden=hidden, batch=batch
    )
    counts: dict[str, Any] = {"compute": compute.counts}
    epochs = dict(compute.epochs)
    report_metrics = dict(compute.metrics)
    points = dict(compute.points)
    notes.extend(compute.notes)

    mnet: CommNet | None = None
    collectives: dict[str, Any] = {}
    if data.comm is not None:
        comm = train_comm(
            comm_data(data.comm_records),
            holdout_world_size,
            str(data.comm.directory),
            settings,
            hidden=hidden if tiny else 32,  # ~100s of noisy samples: a smaller net
            batch=max(8, batch // 8),
        )
        mnet = comm.net
        counts["comm"] = comm.counts
        epochs.update(comm.epochs)
        report_metrics.update(comm.metrics)
        points.update(comm.points)
        notes.extend(comm.notes)
        fitted = fit_collectives(
            data.comm_records, str(data.comm.directory), cores=data.comm.fingerprint.cores
        )
        collectives = collectives_metadata(fitted.fits)
        if fitted.counts:
            counts["comm_collectives"] = fitted.counts
            report_metrics["comm_collectives"] = fitted.metrics
        notes.extend(fitted.notes)
    else:
        notes.append("no comm dataset: the model has no all-to-all model")

    report = PretrainReport(counts, epochs, report_metrics, notes, points)
    metadata = _metadata(data, report, compute.batch_sizes, seed=seed, tiny=tiny)
    if collectives:  # a model without them prices the collectives on presets
        metadata[COLLECTIVES_KEY] = collectives
    return CostModel(compute.net, mnet, metadata), report


def _metadata(
    data: Datasets, report: PretrainReport, batch_sizes: list[int], *, seed: int, tiny: bool
) -> dict[str, Any]:
    """What the model file says about where it came from."""
    cds, mds, mrecs = data.compute, data.comm, data.comm_records
    metadata: dict[str, Any] = {
        "fingerprint": cds.fingerprint.to_dict(),
        "fingerprint_key": cds.manifest.fingerprint_key,
        "dataset_hashes": {
            "compute": cds.dataset_hash(),
            **({"comm": mds.dataset_hash()} if mds is not None else {}),
        },
        "metrics": report.to_json(),
        "code_version": shardwise.__version__,
        "format_version": FORMAT_VERSION,
        "batch_sizes": list(batch_sizes),
        "comm_batch_sizes": sorted({int(r["batch_size"]) for r in mrecs}),
        "comm_world_sizes": sorted({int(r["world_size"]) for r in mrecs}),
        "seed": seed,
        "tiny": tiny,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    # Plain JSON types only, so torch.load(weights_only=True) reads it back.
    out: dict[str, Any] = json.loads(json.dumps(metadata, default=float))
    return out
