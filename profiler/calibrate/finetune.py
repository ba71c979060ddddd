"""Fine-tuning the compute network on what a calibration measured.

The networks keep predicting in *their* seconds and the speed factors carry this
machine's speed (:mod:`.speed`): the targets are the measured seconds divided by the
factors, so the fine-tune starts from a model that is already about right here and
only has to learn what a factor cannot (these tables' shape, the fused-kernel
effects at these batches). Costs are first brought to the median machine speed with
the reference kernel timed beside the samples, as pre-training does, unless the
calibration found that correction widens the spread of its anchors (``drift`` off).

Early stopping watches the validation *tables* (:mod:`.tasks`), and the fine-tuned
network is kept only when it beats the speed-corrected base on them: a fine-tune on
too few samples must never make the model worse than the factors alone.
The comm network is not fine-tuned (a calibration measures only a few small
all-to-alls, enough for its factor).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardwise.planner.costmodel.artifact import CostModel, SpeedFactors
from shardwise.planner.costmodel.features import Normalizer
from shardwise.planner.costmodel.networks import ComputeNet
from shardwise.profiler.pretrain.data import compute_data
from shardwise.profiler.pretrain.training import EpochProgress, _compute_loss, fit

#: Fewest samples a fine-tune trains / validates on; below, the factors alone are kept.
MIN_TRAIN = 12
MIN_VAL = 3
#: Validation share of the training samples when the job has no validation tables.
VAL_SAMPLE_SHARE = 0.15
MAX_EPOCHS = 400
PATIENCE = 30


@dataclass
class FineTune:
    """What the fine-tune did; ``net`` is the network to ship (the base's if not kept)."""

    net: ComputeNet
    kept: bool
    counts: dict[str, int]
    base_val_loss: float = math.nan
    best_val_loss: float = math.nan
    epochs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "kept": self.kept,
            "counts": dict(self.counts),
            "base_val_loss": num(self.base_val_loss),
            "best_val_loss": num(self.best_val_loss),
            "epochs": dict(self.epochs),
        }


def finetune(
    base: CostModel,
    factors: SpeedFactors,
    train_records: Sequence[Mapping[str, Any]],
    val_records: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    deadline: float | None,
    from_scratch: bool = False,
    hidden: int = 64,
    on_epoch: Callable[[EpochProgress], None] | None = None,
    drift: bool = True,
) -> FineTune:
    """Fine-tune (or, ``from_scratch``, train anew) the compute network; see the module
    docstring. One torch thread: the nets are small and a measurement may share the host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _finetune(
            base, factors, list(train_records), list(val_records), seed, deadline,
            from_scratch, hidden, on_epoch, drift,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _finetune(
    base: CostModel,
    factors: SpeedFactors,
    train_records: list[Mapping[str, Any]],
    val_records: list[Mapping[str, Any]],
    seed: int,
    deadline: float | None,
    from_scratch: bool,
    hidden: int,
    on_epoch: Callable[[EpochProgress], None] | None,
    drift: bool,
) -> FineTune:
    notes: list[str] = []
    if not val_records and len(train_records) >= MIN_TRAIN + MIN_VAL:
        order = np.random.default_rng(seed).permutation(len(train_records))
        n_val = max(MIN_VAL, round(VAL_SAMPLE_SHARE * len(train_records)))
        val_records = [train_records[int(i)] for i in order[:n_val]]
        train_records = [train_records[int(i)] for i in sorted(order[n_val:])]
        notes.append("the job has too few tables for validation tables: validated on samples")
    counts = {"train": len(train_records), "val": len(val_records)}
    if len(train_records) < MIN_TRAIN or len(val_records) < MIN_VAL:
        notes.append(
            f"too few samples to fine-tune ({counts['train']} training, {counts['val']} "
            f"validation; {MIN_TRAIN} and {MIN_VAL} needed): kept the base with its factors"
        )
        return FineTune(base.compute, False, counts, notes=notes)
    records = [dict(r) for r in [*train_records, *val_records]]
    data = compute_data(records, drift)
    shift = torch.tensor([math.log(factors.fwd), math.log(factors.bwd)], dtype=data.y.dtype)
    data.y = data.y - shift
    n_train = len(train_records)
    train = data.take(range(n_train))
    val = data.take(range(n_train, len(records)))
    with torch.no_grad():
        base_loss = float(_compute_loss(base.compute, val))
    torch.manual_seed(seed)
    if from_scratch:
        net = ComputeNet(hidden=hidden)
        net.table_norm = Normalizer.fit(train[0][train[1].bool()].numpy())
        net.set_norm = Normalizer.fit(train[2].numpy())
        lr = 3e-3
    else:
        net = copy.deepcopy(base.compute)
        lr = 1e-3
    epochs = fit(
        net,
        _compute_loss,
        train,
        val,
        name="fine-tune",
        seed=seed,
        max_epochs=MAX_EPOCHS,
        patience=PATIENCE,
        batch_size=min(64, max(8, n_train // 8)),
        lr=lr,
        on_epoch=on_epoch,
        deadline=deadline,
    )
    best = float(epochs["best_val_loss"])
    kept = best < base_loss
    if not kept:
        notes.append(
            f"the fine-tuned network did not beat the base with its factors on the validation "
            f"tables (loss {best:.4f} against {base_loss:.4f}): kept the base"
        )
    return FineTune(net if kept else base.compute, kept, counts, base_loss, best, epochs, notes)
