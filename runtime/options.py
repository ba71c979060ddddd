"""What a caller hands the trainer: its options, and the shapes of its model, data
and loss factories. They live apart from the training loop (:mod:`.trainer`, which
re-exports them) so that each module holds one concept."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from shardwise.basics import UserError
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.torchrec_plan import DEFAULT_MODULE_PATH
from shardwise.runtime.env import WorkerEnv
from shardwise.runtime.live_report import DEFAULT_MIN_INTERVAL, DEFAULT_REPORT_EVERY
from shardwise.runtime.sharding import EmbeddingOptimizer

#: A hard node loss costs at most this many steps (a save every few minutes at most on
#: GPUs, every 10-30 s on CPU); a save takes well under a second for small tables.
DEFAULT_CHECKPOINT_EVERY = 500

Batch = tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]
"""One rank's batch: dense features ``[B, D]``, sparse features (a KJT keyed by the
tables' feature names) and labels ``[B]``. The model is called as
``model(dense, sparse)`` and returns one logit per sample (``[B]`` or ``[B, 1]``)."""

Batches = Callable[[int], Batch]
"""step -> this rank's batch of that step (training steps count from 1; step 0 is the
one :attr:`TrainOptions.check_unsharded` compares on). Make it deterministic in the
step, so a resumed run sees the batches an uninterrupted one would have seen."""

Tables = Sequence[TableSpec] | str | Path | Callable[[], Sequence[TableSpec]]
"""The specs the plan was made from: the specs, a tables file, or a function that
returns them (its :class:`UserError` is reported like a bad plan's, status 2)."""


@dataclass(frozen=True)
class Worker:
    """This rank as the runtime resolved it, handed to the model and data factories."""

    env: WorkerEnv
    #: The table specs, checked against the plan.
    tables: list[TableSpec]
    plan: Plan
    #: This rank's device: ``cuda:LOCAL_RANK`` on a GPU host, else the CPU.
    device: torch.device
    #: Samples per rank and step: :attr:`TrainOptions.batch_size` or the plan's.
    batch_size: int


ModelFactory = Callable[[Worker, torch.device, torch.device], nn.Module]
"""``(worker, embedding_device, dense_device) -> model``, its EmbeddingBagCollection at
:attr:`TrainOptions.module_path` with one table per spec, named like it. Called with
(``meta``, the rank's device) for the model to shard (DMP allocates only this rank's
shards) and, for :attr:`TrainOptions.check_unsharded`, with (cpu, cpu) for an unsharded
reference. The runtime seeds torch first (``seed``, and ``seed + 1`` for the
reference)."""

DataFactory = Callable[[Worker], Batches]
"""``worker -> batches``: called once, after the model is sharded."""

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: The least value of each numeric option (the flags of ``train.py`` check the same).
MINIMUMS = (
    ("steps", 0),
    ("checkpoint_every", 0),
    ("keep", 1),
    ("measure_every", 0),
    ("report_every", 0),
    ("report_min_interval", 0),
)


@dataclass(frozen=True)
class TrainOptions:
    """How to train; every field has the default of the entry's flag of the same name."""

    #: plan.json; ``None``: ``$SHARDWISE_PLAN``.
    plan: Path | None = None
    #: Train until this step (a resumed run goes on from its checkpoint's step).
    steps: int = 100
    #: Samples per rank and step; ``None``: the plan's ``batch_size_per_rank``, so the
    #: measured cost is comparable with the plan's prediction.
    batch_size: int | None = None
    #: The dense layers' Adagrad learning rate.
    lr: float = 0.05
    #: The optimizer fused into the embedding kernels' backward.
    embedding_optimizer: EmbeddingOptimizer = field(default_factory=EmbeddingOptimizer)
    #: Seeds torch before the model is built.
    seed: int = 0
    #: Where the model's EmbeddingBagCollection sits (the plan is keyed by it).
    module_path: str = DEFAULT_MODULE_PATH
    #: Save here (shared by every rank) and resume from its latest checkpoint.
    checkpoint_dir: Path | None = None
    #: Also save every N steps (0: only at the end and on a stop): the bound on the
    #: work a hard node loss costs.
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    #: Checkpoints to keep.
    keep: int = 2
    #: Resume from ``checkpoint_dir``'s latest checkpoint (False: start afresh).
    resume: bool = True
    #: Recorded in each checkpoint's ``shardwise.json`` (``extra``).
    checkpoint_extra: Mapping[str, Any] = field(default_factory=dict)
    #: Time the embedding phases every N steps (0: off).
    measure_every: int = 10
    #: Rank 0 prints every N steps (0: never).
    log_every: int = 10
    #: With ``SHARDWISE_LIVE_CONFIGMAP`` set: every rank's measured cost is gathered
    #: every N steps and rank 0 writes the live summary (0: never; unset: never).
    report_every: int = DEFAULT_REPORT_EVERY
    #: Time each shard of each rank in bounded probe windows (only when reporting).
    probe: bool = True
    #: Rank 0 writes the summary at most once per this many seconds (the last write,
    #: before a stop's checkpoint and at the end, excepted).
    report_min_interval: float = DEFAULT_MIN_INTERVAL
    #: Before training, copy an unsharded model's weights into the sharded one and check
    #: both give the same output (small tables only; not with a resume).
    check_unsharded: bool = False
    #: Rank 0 writes every table in full, the dense weights and the embedding optimizer
    #: state here before the first step (after a resume: what was loaded) / at the end.
    export_start: Path | None = None
    export_end: Path | None = None
    #: Rank 0 writes a JSON run summary here.
    summary: Path | None = None

    def __post_init__(self) -> None:
        for name, low in MINIMUMS:
            if getattr(self, name) < low:
                raise UserError(f"{name} must be at least {low}, not {getattr(self, name)}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise UserError(f"batch_size must be at least 1, not {self.batch_size}.")
