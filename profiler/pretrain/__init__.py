"""Pre-training the cost models on profiler datasets (``shardwise pretrain``).

Input: a directory holding ``compute/`` (required) and ``comm/`` cost datasets (or
a compute dataset itself). Output: a :class:`~shardwise.planner.costmodel.CostModel`
and a :class:`PretrainReport` with test-split metrics.

- :mod:`.data`: the datasets, checked, as tensors, and the splits: compute *by
  table* (no test table, nor any of its width variants, is seen in training),
  comm by sample; a record that lists its kernels (row-wise ranges, data-parallel
  copies beside fused shards) gives one example per kernel;
- :mod:`.training`: Adam on the mean squared error of log-seconds with early
  stopping, one function per model; the comm model is first trained without one
  world size (the generalization figure), then refitted with it for shipping; the
  collectives the comm dataset recorded (reduce-scatter, all-reduce) get one α–β
  line per world size, kept in the model file (``metadata["comm_collectives"]``);
- :mod:`.report`: MAPE, R² and Spearman's rho, the host's drift, and the report;
- :mod:`.pipeline`: :func:`pretrain`, all of it end to end.

The names below are re-exported for importers of ``shardwise.profiler.pretrain``.
"""

from shardwise.profiler.pretrain.data import ComputeSplit, drift_factors, split_compute
from shardwise.profiler.pretrain.pipeline import pretrain
from shardwise.profiler.pretrain.report import PretrainReport, metrics
from shardwise.profiler.pretrain.training import (
    DEFAULT_MAX_EPOCHS,
    DEFAULT_PATIENCE,
    EpochProgress,
)

__all__ = [
    "DEFAULT_MAX_EPOCHS",
    "DEFAULT_PATIENCE",
    "ComputeSplit",
    "EpochProgress",
    "PretrainReport",
    "drift_factors",
    "metrics",
    "pretrain",
    "split_compute",
]
