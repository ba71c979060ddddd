"""What the cost models see: raw table, set and rank features, and their normalization.

The feature tuples fix the order of the networks' inputs; changing a feature's
meaning means bumping :data:`~shardwise.planner.costmodel.artifact.FORMAT_VERSION`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from shardwise.planner.access import NUM_BINS
from shardwise.planner.streams import BIN_MEAN_COUNT

if TYPE_CHECKING:
    from shardwise.planner.tables import TableSpec

#: What identifies a shard to the caches: (table name, rows, columns, dtype, pooling).
TableKey = tuple[str, int, int, str, float]


def table_key(spec: TableSpec, cols: int) -> TableKey:
    return (spec.name, spec.rows, cols, spec.dtype, spec.pooling_factor)


#: Per-table inputs of :class:`~shardwise.planner.costmodel.networks.ComputeNet`
#: (in this order).
TABLE_FEATURES: tuple[str, ...] = (
    *(f"hist{k}" for k in range(NUM_BINS)),
    "log2_cols",
    "log1p_pooling",
    "log_rows",
    "fp16",
    "log1p_pooling_x_cols",
    "log_batch",
    "log1p_lookups",  # batch × pooling: indices the kernel reads
    "log1p_elements",  # batch × pooling × cols: values it pools
    "log1p_unique",  # unique rows read per batch (what the optimizer updates)
    "log1p_unique_x_cols",  # … times the width: the backward's row-wise update work
)
#: Per-sample inputs of the compute head.
SET_FEATURES: tuple[str, ...] = ("log_batch", "log_tables")
#: Per-rank inputs of :class:`~shardwise.planner.costmodel.networks.CommNet`.
RANK_FEATURES: tuple[str, ...] = (
    "log1p_send",  # elements this rank sends in all: W × batch × dim
    "log1p_recv",  # elements it receives: batch × sum of dims
    "log1p_moved",  # elements the whole collective moves: W × batch × sum of dims
    "share",  # dim / sum of dims
    "idle",  # dim == 0
    "delay_ms",
    "wait_ms",  # max delay - own delay: the straggler wait
    "log1p_max_send",
    "log_world",
    "rel_dim",  # dim / max dim
)


def table_features(
    access_hist: Sequence[float],
    cols: int,
    pooling_factor: float,
    rows: int,
    dtype: str,
    batch_size: int,
) -> list[float]:
    """Raw (unnormalized) :data:`TABLE_FEATURES` of one table or column shard."""
    lookups = batch_size * pooling_factor
    unique = unique_rows(access_hist, rows, pooling_factor, batch_size)
    return [
        *(float(x) for x in access_hist),
        math.log2(cols),
        math.log1p(pooling_factor),
        math.log(rows),
        1.0 if dtype == "fp16" else 0.0,
        math.log1p(pooling_factor * cols),
        math.log(batch_size),
        math.log1p(lookups),
        math.log1p(lookups * cols),
        math.log1p(unique),
        math.log1p(unique * cols),
    ]


def unique_rows(
    access_hist: Sequence[float], rows: int, pooling_factor: float, batch_size: int
) -> float:
    """Rows one batch reads at least once, as the profiler's stream generator derives
    them from the histogram (what the optimizer updates; the kernel's working set)."""
    lookups = batch_size * pooling_factor
    mean_count = float(np.dot(np.asarray(access_hist, dtype=np.float64), BIN_MEAN_COUNT))
    return min(float(rows), lookups, lookups / mean_count if mean_count > 0 else lookups)


def set_features(batch_size: int, n_tables: int) -> list[float]:
    return [math.log(batch_size), math.log(max(n_tables, 1))]


def rank_features(
    dims: Sequence[int], delays: Sequence[float], batch_size: int
) -> npt.NDArray[np.float64]:
    """Raw :data:`RANK_FEATURES` of every rank of one all-to-all, ``[W, F]``."""
    one: npt.NDArray[np.float64] = rank_features_many(
        np.asarray([dims], dtype=np.float64), np.asarray([delays], dtype=np.float64), batch_size
    )[0]
    return one


def rank_features_many(
    dims: npt.NDArray[np.float64], delays: npt.NDArray[np.float64], batch_size: int
) -> npt.NDArray[np.float64]:
    """:func:`rank_features` of ``M`` collectives of one world size: ``[M, W]`` → ``[M, W, F]``."""
    d, t = dims, delays
    m, w = d.shape
    total = d.sum(axis=1, keepdims=True)
    top = d.max(axis=1, keepdims=True) if w else np.zeros((m, 1))
    safe_total = np.where(total > 0, total, 1.0)
    safe_top = np.where(top > 0, top, 1.0)
    full = np.ones((m, w))
    return np.stack(
        [
            np.log1p(w * batch_size * d),
            full * np.log1p(batch_size * total),
            full * np.log1p(w * batch_size * total),
            np.where(total > 0, d / safe_total, 0.0),
            (d == 0).astype(np.float64),
            t * 1e3,
            (t.max(axis=1, keepdims=True) - t) * 1e3 if w else t,
            full * np.log1p(batch_size * top),
            full * math.log(max(w, 1)),
            np.where(top > 0, d / safe_top, 0.0),
        ],
        axis=2,
    )


@dataclass
class Normalizer:
    """Per-feature mean and std (std of a constant feature is 1: it passes through)."""

    mean: list[float]
    std: list[float]

    @classmethod
    def identity(cls, n: int) -> Normalizer:
        """``n`` features passed through unchanged (an untrained network's)."""
        return cls([0.0] * n, [1.0] * n)

    @classmethod
    def fit(cls, x: npt.NDArray[np.floating[Any]]) -> Normalizer:
        mean = x.mean(axis=0)
        std = x.std(axis=0)
        std = np.where(std < 1e-6, 1.0, std)
        return cls([float(v) for v in mean], [float(v) for v in std])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return (x - torch.tensor(self.mean, dtype=x.dtype)) / torch.tensor(self.std, dtype=x.dtype)

    def to_dict(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Normalizer:
        return cls([float(v) for v in d["mean"]], [float(v) for v in d["std"]])
