"""The default entry's model and data: TorchRec's DLRM over the plan's tables, trained on
synthetic but learnable batches.

:func:`build_model` is a :data:`~.trainer.ModelFactory` once its dense width is bound,
:class:`SyntheticData` gives a :data:`~.trainer.DataFactory`'s batches; :mod:`.train`
wires both into :func:`.trainer.train`. :func:`drifted_specs` stands for real data that
drift from the declared specs: the lookups are drawn from other pooling factors and
histograms than the plan was made for. A training script with a model of its own
needs neither (see ``examples/train_dlrm.py``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DenseArch, InteractionArch, OverArch

from shardwise.basics import UserError
from shardwise.planner.streams import stream_from_spec
from shardwise.planner.tables import TableSpec
from shardwise.planner.torchrec_plan import embedding_bag_configs

# --------------------------------------------------------------------------- the model


class ProjectedSparseArch(nn.Module):
    """DLRM's sparse arch for tables of mixed widths: each table's pooled embedding is
    projected to one width (a bias-free linear map, trained with the dense layers)."""

    def __init__(self, ebc: EmbeddingBagCollection, dim: int, device: torch.device) -> None:
        super().__init__()
        self.embedding_bag_collection = ebc
        configs = ebc.embedding_bag_configs()
        self.names = [c.name for c in configs]
        self.projections = nn.ModuleDict(
            {c.name: nn.Linear(c.embedding_dim, dim, bias=False, device=device) for c in configs}
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.stack([self.projections[n](pooled[n]) for n in self.names], dim=1)


class ProjectedDLRM(nn.Module):
    """``torchrec.models.dlrm.DLRM`` with :class:`ProjectedSparseArch`; its other parts
    (``DenseArch``, ``InteractionArch``, ``OverArch``) are TorchRec's."""

    def __init__(
        self, ebc: EmbeddingBagCollection, dense_in: int, dim: int, device: torch.device
    ) -> None:
        super().__init__()
        num_sparse = len(ebc.embedding_bag_configs())
        self.dense_arch = DenseArch(dense_in, [64, dim], device=device)
        self.sparse_arch = ProjectedSparseArch(ebc, dim, device)
        self.inter_arch = InteractionArch(num_sparse_features=num_sparse)
        over_in = dim + num_sparse * (num_sparse - 1) // 2 + num_sparse
        self.over_arch = OverArch(over_in, [64, 32, 1], device=device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> Any:
        dense = self.dense_arch(dense_features)
        sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=dense, sparse_features=sparse))


def build_model(
    tables: Sequence[TableSpec],
    dense_features: int,
    embedding_device: torch.device,
    dense_device: torch.device,
) -> nn.Module:
    """TorchRec's DLRM with its EmbeddingBagCollection at
    ``sparse_arch.embedding_bag_collection``, the module path plans are keyed by.

    The collection goes on ``embedding_device``: ``meta`` for the model to shard (DMP
    allocates only this rank's shards), a real device for the unsharded reference; the
    dense layers on ``dense_device``. DLRM needs one width for all tables; with mixed
    widths, :class:`ProjectedDLRM`."""
    ebc = EmbeddingBagCollection(embedding_bag_configs(tables), device=embedding_device)
    widths = sorted({t.dim for t in tables})
    if len(widths) == 1:
        model: nn.Module = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dense_features,
            dense_arch_layer_sizes=[64, widths[0]],
            over_arch_layer_sizes=[64, 32, 1],
            dense_device=dense_device,
        )
        return model
    return ProjectedDLRM(ebc, dense_features, widths[-1], dense_device)


# --------------------------------------------------------------------------- the data


class SyntheticData:
    """Learnable batches: lookups drawn from each table's spec, labels a fixed function.

    Every row of every table has a hidden score in [-1, 1] (a hash of the row); a
    sample's label is 1 when ``dense · w + 2 · (sum over tables of the mean score of its
    rows) / sqrt(tables)`` is positive. Deterministic in (seed, step, rank), so a
    resumed run sees the batches an uninterrupted one would have seen.
    """

    def __init__(
        self, tables: Sequence[TableSpec], batch_size: int, dense_features: int, seed: int
    ) -> None:
        self.tables = list(tables)
        self.batch_size = batch_size
        self.seed = seed
        rng = np.random.default_rng([seed, 0x5EED])
        w = rng.standard_normal(dense_features)
        self.dense_weights = w / np.linalg.norm(w)
        self.dense_features = dense_features
        self.salts = [int(x) for x in rng.integers(0, 2**31, len(self.tables))]

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        seed = (self.seed * 1_000_003 + step) * 65_537 + rank
        rng = np.random.default_rng([seed, 1])
        b = self.batch_size
        dense = rng.standard_normal((b, self.dense_features)).astype(np.float32)
        score = np.zeros(b)
        lengths, values = [], []
        for spec, salt in zip(self.tables, self.salts, strict=True):
            lens, idx = stream_from_spec(spec, b, seed)
            lengths.append(lens)
            values.append(idx)
            hashed = (idx.astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt)) % (2**32)
            row_score = hashed.astype(np.float64) / 2**31 - 1.0
            sums = np.bincount(np.repeat(np.arange(b), lens), weights=row_score, minlength=b)
            score += sums / np.maximum(lens, 1)
        logit = dense @ self.dense_weights + 2.0 * score / math.sqrt(len(self.tables))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[t.name for t in self.tables],
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        labels = torch.from_numpy((logit > 0).astype(np.float32))
        return torch.from_numpy(dense), kjt, labels


# --------------------------------------------------------------------------- data drift


def drifted_specs(
    declared: Sequence[TableSpec],
    drawn: Sequence[TableSpec] | None = None,
    pooling: Mapping[str, float] | None = None,
    *,
    source: str = "the data tables",
) -> list[TableSpec]:
    """The specs the synthetic lookups are drawn from when the real data drift from the
    declared ones (what the plan was made for): ``drawn`` in place of the declared specs
    (same tables, rows, widths and dtypes; only ``pooling_factor`` and ``access_hist``
    may differ), then each named table's pooling factor × ``pooling[name]``.

    A mismatch is a :class:`UserError` naming the table and the field (``source``
    names where ``drawn`` came from)."""
    by_name = {t.name: t for t in declared}
    out = list(declared)
    if drawn is not None:
        seen = {t.name: t for t in drawn}
        for name in by_name.keys() - seen.keys():
            raise UserError(
                f"{source}: table {name!r} is declared but missing; the data tables must "
                "list every declared table (only pooling_factor and access_hist may differ)."
            )
        for name in seen.keys() - by_name.keys():
            raise UserError(
                f"{source}: table {name!r} is not a declared table (declared: "
                f"{_some(by_name)}); the data tables must list the declared tables only."
            )
        for t in declared:
            other = seen[t.name]
            for field in ("rows", "dim", "dtype"):
                if getattr(other, field) != getattr(t, field):
                    raise UserError(
                        f"{source}: table {t.name!r} has {field} {getattr(other, field)}, but "
                        f"the declared table has {getattr(t, field)}; only pooling_factor and "
                        "access_hist may differ (the plan's shapes stay)."
                    )
        out = [seen[t.name] for t in declared]
    factors = dict(pooling or {})
    for name, factor in factors.items():
        if name not in by_name:
            raise UserError(f"--data-pooling: no table {name!r}; tables are e.g. {_some(by_name)}.")
        if not math.isfinite(factor) or factor <= 0:
            raise UserError(
                f"--data-pooling: the factor of {name!r} must be above 0, not {factor}."
            )
    scaled = []
    for t in out:
        if t.name not in factors:
            scaled.append(t)
            continue
        factor = factors[t.name]
        try:
            scaled.append(
                TableSpec.model_validate(
                    {**t.model_dump(), "pooling_factor": t.pooling_factor * factor}
                )
            )
        except ValidationError as err:
            reason = str(err.errors()[0]["msg"]).removeprefix("Value error, ")
            raise UserError(f"--data-pooling: table {t.name!r} × {factor:g}: {reason}.") from None
    return scaled


def parse_pooling(text: str) -> dict[str, float]:
    """``NAME=FACTOR[,NAME=FACTOR...]`` (argparse reports a ValueError as a usage error)."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not sep or not name.strip() or not math.isfinite(factor) or factor <= 0:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=FACTOR with a factor above 0 (e.g. table_0003=8)"
            )
        out[name.strip()] = factor
    if not out:
        raise argparse.ArgumentTypeError("give at least one NAME=FACTOR")
    return out


def _some(names: Mapping[str, object], count: int = 5) -> str:
    listed = list(names)
    more = f" … ({len(listed)} in all)" if len(listed) > count else ""
    return ", ".join(listed[:count]) + more
