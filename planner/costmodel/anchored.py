"""A calibrated model's prices of shards and kernels through its rank head: each
shard's solo price (its anchor, or the network's ratio to one, or the network with a
factor), its channels, and a kernel's price and spread
(:mod:`~shardwise.planner.costmodel.rankhead`).

Kept apart from :class:`~shardwise.planner.costmodel.predictor.CostPredictor`, which
holds one of these when its model has a rank head and asks it for every kernel: the
predictor's caches and network stay its own, this adds what measurement brings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from shardwise.planner.costmodel.features import TableKey, table_key, unique_rows
from shardwise.planner.costmodel.rankhead import (
    CHANNELS,
    AnchoredHead,
    RankHead,
    shard_channels,
)
from shardwise.planner.tables import TableSpec, table_signature

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
Shard = tuple[TableSpec, int]


class NetworkPricer(Protocol):
    """What this asks of the predictor that holds it (a
    :class:`~shardwise.planner.costmodel.predictor.CostPredictor`): its network's price
    of shard sets, its NaN check and its cache bound. A protocol, so this module need
    not import the predictor that imports it."""

    max_cache: int

    def network_compute(self, shard_sets: Sequence[Sequence[Shard]], batch_size: int) -> F64: ...

    def _finite(self, values: Any, what: str) -> None: ...


class AnchoredPricer:
    """Prices through ``head`` for ``predictor`` (whose network prices what no anchor
    covers); caches each shard's channels."""

    def __init__(self, predictor: NetworkPricer, head: RankHead) -> None:
        self.predictor, self.head = predictor, head
        self.kernel_head = AnchoredHead(head)
        self._channels: dict[tuple[TableKey, int], F32] = {}
        self._signatures: dict[TableKey, str] = {}

    def clear(self) -> None:
        self._channels.clear()

    def _signature(self, spec: TableSpec) -> str:
        key = (spec.name, spec.rows, spec.dim, spec.dtype, spec.pooling_factor)
        sig = self._signatures.get(key)
        if sig is None:
            sig = self._signatures[key] = table_signature(spec)
        return sig

    def solo(self, shards: Sequence[Shard], batch_size: int) -> tuple[F64, F64]:
        """Each shard alone: (fwd, bwd) seconds ``[N, 2]`` and its own log error spread
        ``[N]``. Its anchor where one was measured at this width and batch (spread 0);
        else the network's price scaled by the table's anchor at another width (the
        network gives the ratio); else the network's price times the calibration's
        factor for unanchored tables. At the head's local batch, a data-parallel copy's
        local anchor comes first (a table with none is scaled from its global one)."""
        head, net = self.head, self.predictor.network_compute
        local = head.local_batch is not None and batch_size == head.local_batch
        n = len(shards)
        own = net([[s] for s in shards], batch_size)
        out = np.zeros((n, 2), dtype=np.float64)
        spread = np.zeros(n, dtype=np.float64)
        scaled: list[tuple[int, TableSpec, int, tuple[float, float], int]] = []
        for i, (spec, cols) in enumerate(shards):
            sig = self._signature(spec)
            anchors, at = head.anchors.get(sig), head.batch
            if local and sig in head.local_anchors:
                anchors, at = head.local_anchors[sig], batch_size
            if not anchors:
                out[i] = own[i] * np.asarray(head.unanchored)
                spread[i] = head.sigma_unanchored
            elif cols in anchors and batch_size == at:
                out[i] = anchors[cols]
            else:
                ref = (
                    cols if cols in anchors else (spec.dim if spec.dim in anchors else max(anchors))
                )
                scaled.append((i, spec, ref, anchors[ref], at))
                spread[i] = head.sigma_scaled
        if scaled:
            refs = np.zeros((len(scaled), 2), dtype=np.float64)
            for b in {x[4] for x in scaled}:
                idx = [k for k, x in enumerate(scaled) if x[4] == b]
                refs[idx] = net([[(scaled[k][1], scaled[k][2])] for k in idx], b)
            for (i, _, _, anchor, _), ref_nn in zip(scaled, refs, strict=True):
                out[i] = own[i] * np.asarray(anchor) / np.maximum(ref_nn, 1e-12)
        self.predictor._finite(out, "solo compute cost")
        return out, spread

    def channels(self, shards: Sequence[Shard], batch_size: int) -> F32:
        """The rank head's channels of each shard ``[N, C]`` (cached per shard)."""
        keys = [(table_key(spec, cols), batch_size) for spec, cols in shards]
        missing = {k: s for k, s in zip(keys, shards, strict=True) if k not in self._channels}
        if missing:
            todo = list(missing.values())
            solo, spread = self.solo(todo, batch_size)
            rows = shard_channels(
                [(float(f), float(b)) for f, b in solo],
                spread.tolist(),
                [
                    unique_rows(spec.access_hist, spec.rows, spec.pooling_factor, batch_size)
                    * cols
                    * spec.bytes_per_element
                    / 2**20
                    for spec, cols in todo
                ],
                [batch_size * spec.pooling_factor for spec, _ in todo],
                [cols for _, cols in todo],
            )
            if len(self._channels) + len(todo) > self.predictor.max_cache:
                self._channels.clear()
            for k, row in zip(missing, rows, strict=True):
                self._channels[k] = row
        if not keys:
            return np.zeros((0, len(CHANNELS)), dtype=np.float32)
        return np.stack([self._channels[k] for k in keys])

    def price(self, groups: Sequence[Sequence[Shard]], batch_size: int) -> F64:
        """(fwd, bwd) seconds ``[N, 2]`` of each kernel: its shards' channels summed,
        then the head."""
        flat = [s for g in groups for s in g]
        channels = self.channels(flat, batch_size)
        index = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        summed = np.zeros((len(groups), channels.shape[1]), dtype=np.float32)
        np.add.at(summed, index, channels)
        counts = np.array([len(g) for g in groups], dtype=np.int64)
        out: F64 = self.kernel_head.seconds(summed, counts).astype(np.float64)
        return out

    def sigmas(self, shard_sets: Sequence[Sequence[Shard]], batch_size: int) -> F64:
        """Each set's log error spread (:meth:`AnchoredHead.sigma` of its channels)."""
        rows = [
            self.channels(list(s), batch_size).sum(axis=0)
            if s
            else np.zeros(len(CHANNELS), dtype=np.float32)
            for s in shard_sets
        ]
        out: F64 = self.kernel_head.sigma(np.stack(rows)) if rows else np.zeros(0)
        return out
