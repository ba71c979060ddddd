"""Training the two networks: Adam on the mean squared error of log-seconds,
minibatches, early stopping on the validation loss (best weights kept), deterministic
for a seed; and one function per model that trains it on its split and measures it on
its test data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from shardwise.basics import UserError
from shardwise.planner.comm.fit import COLLECTIVES as COLLECTIVE_NAMES
from shardwise.planner.comm.fit import collective_points
from shardwise.planner.comm.learned import LearnedCollective, fit_learned
from shardwise.planner.comm.model import format_bandwidth, format_seconds
from shardwise.planner.costmodel.features import Normalizer
from shardwise.planner.costmodel.networks import CommNet, ComputeNet, comm_seconds
from shardwise.profiler.pretrain.data import (
    F64,
    MIN_SPLIT,
    VAL_SAMPLE_SHARE,
    CommData,
    ComputeData,
    compute_data,
    split_compute,
    split_samples,
)
from shardwise.profiler.pretrain.report import DRIFT_BLOCK, block_drift, metrics

DEFAULT_MAX_EPOCHS = 400
DEFAULT_PATIENCE = 40


@dataclass(frozen=True)
class EpochProgress:
    """Passed to ``on_epoch`` after every epoch (the CLI's progress bar)."""

    model: str  # "compute", "compute-final", "comm" or "comm-final"
    epoch: int
    max_epochs: int
    train_loss: float
    val_loss: float
    best_val_loss: float


LossFn = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def _compute_loss(net: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tables, mask, sets, y = batch
    pred: torch.Tensor = net(tables, mask, sets)
    return ((pred - y) ** 2).sum(dim=1).mean()


def _comm_loss(net: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ranks, mask, wait, y = batch
    out = net(ranks, mask)
    fwd, bwd = comm_seconds(out, wait)
    err = (torch.log(fwd) - y[..., 0]) ** 2 + (torch.log(bwd) - y[..., 1]) ** 2
    return (err * mask).sum() / mask.sum().clamp(min=1.0)


def fit(
    net: nn.Module,
    loss_fn: LossFn,
    train: tuple[torch.Tensor, ...],
    val: tuple[torch.Tensor, ...],
    *,
    name: str,
    seed: int,
    max_epochs: int,
    patience: int,
    batch_size: int,
    lr: float,
    on_epoch: Callable[[EpochProgress], None] | None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Adam with early stopping on the validation loss; keeps the best weights.

    ``deadline`` (a ``time.monotonic()`` value) also ends training after the epoch that
    passes it: a calibration has a time budget.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    n = train[0].shape[0]
    best, best_epoch, best_state = math.inf, 0, None
    epoch = 0
    out_of_time = False
    for epoch in range(1, max_epochs + 1):
        net.train()
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = perm[start : start + batch_size]
            loss = loss_fn(net, tuple(t[idx] for t in train))
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.detach()) * len(idx)
        net.eval()
        with torch.no_grad():
            val_loss = float(loss_fn(net, val))
        if val_loss < best - 1e-6:
            best, best_epoch = val_loss, epoch
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if on_epoch:
            on_epoch(EpochProgress(name, epoch, max_epochs, total / n, val_loss, best))
        if epoch - best_epoch >= patience:
            break
        if deadline is not None and time.monotonic() >= deadline:
            out_of_time = True
            break
    if best_state is not None:
        net.load_state_dict(best_state)
    net.eval()
    return {
        "epochs": epoch,
        "best_epoch": best_epoch,
        "stopped_early": epoch < max_epochs,
        "best_val_loss": best,
        **({"out_of_time": True} if out_of_time else {}),
    }


def _predict_compute(net: ComputeNet, batch: tuple[torch.Tensor, ...]) -> F64:
    with torch.no_grad():
        out: F64 = torch.exp(net(*batch[:3])).double().numpy()
    return out


def _predict_comm(net: CommNet, batch: tuple[torch.Tensor, ...]) -> tuple[F64, F64, F64, F64]:
    """Per real rank, flattened: predicted fwd, bwd and measured fwd, bwd seconds."""
    ranks, mask, wait, y = batch
    with torch.no_grad():
        fwd, bwd = comm_seconds(net(ranks, mask).double(), wait.double())
    m = mask.bool()
    true = torch.exp(y.double())
    return (
        fwd[m].numpy(),
        bwd[m].numpy(),
        true[..., 0][m].numpy(),
        true[..., 1][m].numpy(),
    )


def _comm_metrics(net: CommNet, batch: tuple[torch.Tensor, ...]) -> tuple[dict[str, Any], F64]:
    pf, pb, tf, tb = _predict_comm(net, batch)
    return {
        "fwd": metrics(pf, tf),
        "bwd": metrics(pb, tb),
        "total": metrics(pf + pb, tf + tb),
    }, np.stack([pf, pb, tf, tb])


# --------------------------------------------------------------------------- per model


@dataclass(frozen=True)
class FitSettings:
    """What every model's training shares: the seed and :func:`fit`'s schedule."""

    seed: int
    lr: float
    max_epochs: int
    patience: int
    on_epoch: Callable[[EpochProgress], None] | None = None

    def fit(
        self,
        net: nn.Module,
        loss_fn: LossFn,
        train: tuple[torch.Tensor, ...],
        val: tuple[torch.Tensor, ...],
        *,
        name: str,
        batch_size: int,
    ) -> dict[str, Any]:
        return fit(
            net,
            loss_fn,
            train,
            val,
            name=name,
            seed=self.seed,
            max_epochs=self.max_epochs,
            patience=self.patience,
            batch_size=batch_size,
            lr=self.lr,
            on_epoch=self.on_epoch,
        )


@dataclass(kw_only=True)
class Training:
    """What training one model adds to the report (in the order it was found)."""

    counts: dict[str, Any]
    epochs: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    #: (panel, label) -> (predicted, measured) seconds, for the scatter plot.
    points: dict[tuple[str, str], tuple[F64, F64]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class ComputeTraining(Training):
    net: ComputeNet
    batch_sizes: list[int]


@dataclass(kw_only=True)
class CommTraining(Training):
    net: CommNet


@dataclass(kw_only=True)
class CollectivesTraining(Training):
    """The other kinds' collectives, fitted: what goes into ``metadata["comm_collectives"]``."""

    fits: dict[str, LearnedCollective]


def train_compute(
    records: list[dict[str, Any]], source: str, settings: FitSettings, *, hidden: int, batch: int
) -> ComputeTraining:
    """The compute model, split by table (see :mod:`.data`), and its test metrics."""
    cdata = compute_data(records)
    split = split_compute(cdata.bases, settings.seed)
    for part in ("train", "val", "test"):
        got = len(getattr(split, part))
        if got < MIN_SPLIT:
            raise UserError(
                f"{source}: the by-table split leaves {got} {part} examples "
                f"(of {len(cdata.record_of)} kernels in {len(records)} samples over "
                f"{len(split.train_tables) + len(split.test_tables)} tables); at least "
                f"{MIN_SPLIT} are needed. Collect more samples or "
                "profile over more tables."
            )
    # At least ~10 steps an epoch, so small datasets still train in few epochs.
    cbatch = min(batch, max(32, len(split.train) // 10))
    cnet, epochs = _fit_compute(cdata, split.train, split.val, settings, hidden, cbatch, "compute")
    batch_sizes = sorted(set(cdata.batch_sizes))
    out = ComputeTraining(
        net=cnet,
        epochs={"compute": epochs},
        batch_sizes=batch_sizes,
        counts={
            "samples": len(records),
            "examples": len(cdata.record_of),
            "train": len(split.train),
            "val": len(split.val),
            "test": len(split.test),
            "test_strict": len(split.test_strict),
            "unused": len(cdata.record_of) - len(split.train) - len(split.val) - len(split.test),
            "tables": len(split.train_tables) + len(split.test_tables),
            "test_tables": len(split.test_tables),
            "batch_sizes": batch_sizes,
        },
    )
    test = cdata.take(split.test)
    pred = _predict_compute(cnet, test)
    true = torch.exp(test[3].double()).numpy()
    strict_pos = [split.test.index(i) for i in split.test_strict]
    out.metrics["compute"] = {
        "total": metrics(pred.sum(1), true.sum(1)),
        "total_strict": metrics(pred[strict_pos].sum(1), true[strict_pos].sum(1)),
        "fwd": metrics(pred[:, 0], true[:, 0]),
        "bwd": metrics(pred[:, 1], true[:, 1]),
        "constant_baseline_mape": metrics(
            np.full(
                len(true), float(np.median(torch.exp(cdata.y[split.train].double()).numpy().sum(1)))
            ),
            true.sum(1),
        )["mape"],
    }
    out.points[("compute", "test")] = (pred.sum(1), true.sum(1))
    drift = block_drift(split.test, pred.sum(1), true.sum(1))
    if drift is not None:
        out.metrics["compute"]["drift_block_median_error"] = list(drift)
        if drift[1] - drift[0] > 0.1:
            out.notes.append(
                "the host's speed drifted while the compute data was collected: the median "
                f"error of consecutive test samples (blocks of {DRIFT_BLOCK}) ranges from "
                f"{drift[0]:+.0%} to {drift[1]:+.0%}; no model of the kernel can predict "
                "that, so it bounds the MAPE (collect on a quiet machine)"
            )
    if len(split.test_strict) < MIN_SPLIT:
        out.notes.append(
            f"only {len(split.test_strict)} test samples have every table unseen; "
            "their metrics are noisy"
        )
    # The shipped network, trained again on every example: the test examples (those
    # reading a test table, 40-60 % of the kernels of an 8-table sample) join the
    # training and validation shares. The split run's test metrics stay the honest
    # figure of the method; the shipped network is judged on a family it never saw
    # (`make pretrain`'s held-out check). Without the refit it learned from about half
    # the measured kernels.
    order = np.random.default_rng(settings.seed + 7).permutation(len(split.test))
    rest = [split.test[i] for i in order]
    n_val = round(VAL_SAMPLE_SHARE * len(rest))
    train_idx, val_idx = sorted(split.train + rest[n_val:]), sorted(split.val + rest[:n_val])
    out.net, out.epochs["compute-final"] = _fit_compute(
        cdata, train_idx, val_idx, settings, hidden, cbatch, "compute-final"
    )
    out.counts["final"] = {"train": len(train_idx), "val": len(val_idx)}
    return out


def _fit_compute(
    cdata: ComputeData,
    train_idx: list[int],
    val_idx: list[int],
    settings: FitSettings,
    hidden: int,
    batch: int,
    name: str,
) -> tuple[ComputeNet, dict[str, Any]]:
    """A fresh compute network (seeded), its normalizers fitted on ``train_idx``'s real
    tables (not padding), trained with early stopping on ``val_idx``."""
    torch.manual_seed(settings.seed)
    net = ComputeNet(hidden=hidden)
    train = cdata.take(train_idx)
    net.table_norm = Normalizer.fit(train[0][train[1].bool()].numpy())
    net.set_norm = Normalizer.fit(train[2].numpy())
    epochs = settings.fit(
        net, _compute_loss, train, cdata.take(val_idx), name=name, batch_size=batch
    )
    return net, epochs


def train_comm(
    data: CommData,
    holdout: int | None,
    source: str,
    settings: FitSettings,
    *,
    hidden: int,
    batch: int,
) -> CommTraining:
    """The all-to-all model, split by sample, with one world size held out.

    The world size ``holdout`` is held out entirely: the first model is trained
    without it and its metrics on that world size are the honest generalization
    figure. The shipped model is then re-fitted with that world size's samples added
    (same split shares), because the evaluator runs such plans; the metrics show both
    (``comm`` / ``comm_unseen_world`` for the first model, ``comm_final`` for the
    shipped one).
    """
    notes: list[str] = []
    worlds = sorted(set(data.world))
    if holdout is not None and (holdout not in worlds or len(worlds) < 2):
        notes.append(
            f"world size {holdout} cannot be held out (the comm data has {worlds}); "
            "no unseen-world-size figure"
        )
        holdout = None
    held = [i for i, w in enumerate(data.world) if w == holdout]
    seen = [i for i, w in enumerate(data.world) if w != holdout]
    tr, va, te = split_samples(seen, settings.seed)
    if min(len(tr), len(va), len(te)) < 1 or len(tr) < MIN_SPLIT:
        raise UserError(
            f"{source}: {len(seen)} all-to-all samples outside the held-out world size "
            f"give train/val/test {len(tr)}/{len(va)}/{len(te)}; at least {MIN_SPLIT} "
            "training samples and one of each other split are needed. Collect more."
        )
    epochs: dict[str, dict[str, Any]] = {}

    def train_one(name: str, tr: list[int], va: list[int]) -> CommNet:
        torch.manual_seed(settings.seed)
        net = CommNet(hidden=hidden)
        part = data.take(tr)
        net.rank_norm = Normalizer.fit(part[0][part[1].bool()].numpy())
        epochs[name] = settings.fit(
            net, _comm_loss, part, data.take(va), name=name, batch_size=batch
        )
        return net

    net = train_one("comm", tr, va)
    out = CommTraining(
        net=net,
        epochs=epochs,
        notes=notes,
        counts={
            "samples": len(data.world),
            "train": len(tr),
            "val": len(va),
            "test": len(te),
            "holdout_world_size": holdout,
            "holdout": len(held),
            "world_sizes": worlds,
        },
    )
    out.metrics["comm"], arr = _comm_metrics(net, data.take(te))
    out.points[("comm fwd", "test")] = (arr[0], arr[2])
    out.points[("comm bwd", "test")] = (arr[1], arr[3])
    if not held:
        return out
    out.metrics["comm_unseen_world"], arr = _comm_metrics(net, data.take(held))
    out.points[("comm fwd", f"unseen W={holdout}")] = (arr[0], arr[2])
    out.points[("comm bwd", f"unseen W={holdout}")] = (arr[1], arr[3])
    # Refit with the held-out world size split like the others (see the docstring).
    htr, hva, hte = split_samples(held, settings.seed + 7)
    out.net = train_one("comm-final", sorted(tr + htr), sorted(va + hva))
    out.metrics["comm_final"], _ = _comm_metrics(out.net, data.take(sorted(te + hte)))
    out.counts["final"] = {"train": len(tr) + len(htr), "val": len(va) + len(hva)}
    out.counts["final"]["test"] = len(te) + len(hte)
    return out


def fit_collectives(
    records: list[dict[str, Any]], source: str, *, cores: int
) -> CollectivesTraining:
    """The reduce-scatter (with its all-gather) and the all-reduce the comm samples
    measured beside their all-to-alls, one α–β line a collective and world size
    (:func:`~shardwise.planner.comm.learned.fit_learned`; ``cores``: the measuring
    host's), and how far each line is off the points it was fitted to.

    A line has two numbers, so it is judged on its own points: its error says how
    well one line holds over the sizes measured, not how it does on sizes unseen.
    """
    fits = fit_learned(records, source, cores=cores)
    points = collective_points(records)
    out = CollectivesTraining(fits=fits, counts={})
    for name, fit in sorted(fits.items()):
        by_world: dict[str, Any] = {}
        for line in fit.lines:
            pts = points[name].at(line.world)
            xs, ys = np.asarray(pts.xs), np.asarray(pts.ys)
            by_world[str(line.world)] = metrics(line.alpha_s + xs / line.bytes_per_s, ys)
        out.counts[name] = {"records": {str(x.world): x.records for x in fit.lines}}
        out.metrics[name] = {"by_world": by_world}
        each = "; ".join(
            f"W {x.world}: α {format_seconds(x.alpha_s)}, {format_bandwidth(x.bytes_per_s)}, "
            f"{x.records} measured, MAPE {100 * by_world[str(x.world)]['mape']:.0f} %"
            for x in fit.lines
        )
        honest = (
            f"labelled learned up to W {fit.honest_up_to}, modelled above"
            if fit.honest_up_to < max(fit.world_sizes)
            else "labelled learned at every measured W"
        )
        out.notes.append(f"{fit.what}s ({fit.measured_on}) fitted by world size: {each}; {honest}")
    missing = sorted(set(COLLECTIVE_NAMES) - set(fits))
    if missing:
        out.notes.append(
            f"no fit of {', '.join(missing)} (the comm dataset measured none at 2 sizes or "
            "more): the model prices them on presets"
        )
    return out
