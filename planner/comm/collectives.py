"""The collectives besides the pooled all-to-all, by sharding kind (docs/comm.md).

Table-wise and column-wise shards send their pooled outputs through one all-to-all
(:class:`~shardwise.planner.comm.model.CommModel`). The other kinds
(:mod:`shardwise.planner.kinds`) add their own collectives, each batched over the
tables of that kind as TorchRec batches them:

- **row-wise**: every rank holds a partial pooled output for every sample of the
  global batch; a reduce-scatter sums them (forward), an all-gather sends the
  gradients back (backward). A ring moves ``(W - 1) × batch × dims × 4`` bytes per
  rank each way, over the slowest link it crosses (between hosts when there are
  several);
- **table-row-wise** and **grid**: the same reduce-scatter within the table's host
  (over the host's link, ``L`` ranks), then an all-to-all of each local rank's share
  of the global batch to the other hosts (``(H - 1) / H`` of it crosses);
- **data-parallel**: no forward exchange; the backward all-reduces the table's
  gradients, ``2 (W - 1) / W × rows × dim × bytes`` per rank in a ring.

These are α–β models on the links of :class:`HostLinks` (declared, and labelled
so, whatever the all-to-all's model is). The ids' all-to-all is left out for every
kind, as it is for the pooled all-to-all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardwise.planner.comm.model import (
    OUTPUT_BYTES,
    PRESETS,
    AlphaBetaComm,
    CommModel,
    default_preset,
)
from shardwise.planner.kinds import HOST_KINDS, V1_KINDS, host_of
from shardwise.planner.plan import PlanTable
from shardwise.planner.tables import DTYPE_BYTES

Array = npt.NDArray[np.float64]


@dataclass(frozen=True)
class HostLinks:
    """The link within a host and the link between hosts, as α–β models."""

    intra: AlphaBetaComm
    inter: AlphaBetaComm

    def describe(self, hosts: int) -> str:
        if hosts <= 1:
            return f"modelled: {self.intra.summary()} within the host"
        return (
            f"modelled: {self.intra.summary()} within a host, {self.inter.summary()} between hosts"
        )


def host_links(comm: CommModel, hosts: int) -> HostLinks:
    """The links a job's collectives are priced on: the declared α–β model when the
    all-to-all has one (for both links on one host; across hosts it is the link
    between them, with NVLink within), else the presets for the job's size."""
    if isinstance(comm, AlphaBetaComm):
        if hosts <= 1:
            return HostLinks(comm, comm)
        return HostLinks(PRESETS["nvlink"], comm)
    return HostLinks(PRESETS["nvlink"], PRESETS["infiniband"] if hosts > 1 else PRESETS["nvlink"])


@dataclass(frozen=True)
class KindTable:
    """What a table of a non-fused kind sends: its kind, width, rows and dtype, and the
    ranks holding it (a table-row-wise or grid table: by host of its column ranges)."""

    kind: str
    dim: int
    rows: int
    dtype: str
    ranks: tuple[int, ...]
    #: Column widths of each host's range (grid: one per column range; else the dim).
    host_dims: Mapping[int, int]


def kind_comm(
    tables: Sequence[KindTable],
    world: int,
    local_world: int,
    batch_size_per_rank: int,
    links: HostLinks,
) -> tuple[Array, Array]:
    """Per-rank (fwd, bwd) seconds ``[W]`` of every collective the tables' kinds add
    (module docstring). Collectives end together, so each costs every rank its time;
    a host-local one costs only that host's ranks."""
    fwd = np.zeros(world)
    bwd = np.zeros(world)
    if world < 2 or not tables:
        return fwd, bwd
    hosts = max(world // local_world, 1)
    sample = batch_size_per_rank * OUTPUT_BYTES
    # Row-wise: one reduce-scatter (fwd) and one all-gather (bwd) over every rank.
    rw_dims = sum(t.dim for t in tables if t.kind == "row_wise")
    if rw_dims:
        link = links.inter if hosts > 1 else links.intra
        t_rs = link.alpha_s + (world - 1) * sample * rw_dims / link.bytes_per_s
        fwd += t_rs
        bwd += t_rs
    # Table-row-wise and grid: a reduce-scatter within each host, then across hosts.
    per_host = np.zeros(hosts)
    for t in tables:
        if t.kind in HOST_KINDS:
            for h, d in t.host_dims.items():
                per_host[h] += d
    if per_host.any():
        share = batch_size_per_rank * world // local_world  # samples per local rank
        intra = np.where(
            per_host > 0,
            links.intra.alpha_s
            + (local_world - 1) * share * OUTPUT_BYTES * per_host / links.intra.bytes_per_s,
            0.0,
        )
        host_of_rank = np.arange(world) // local_world
        fwd += intra[host_of_rank]
        bwd += intra[host_of_rank]
        if hosts > 1:
            cross = (
                links.inter.alpha_s
                + share
                * OUTPUT_BYTES
                * float(per_host.max())
                * (hosts - 1)
                / hosts
                / links.inter.bytes_per_s
            )
            fwd += cross
            bwd += cross
    # Data-parallel: one all-reduce of every such table's gradients (backward).
    dp_bytes = sum(
        t.rows * t.dim * DTYPE_BYTES[t.dtype] for t in tables if t.kind == "data_parallel"
    )
    if dp_bytes:
        link = links.inter if hosts > 1 else links.intra
        bwd += link.alpha_s + 2 * (world - 1) / world * dp_bytes / link.bytes_per_s
    return fwd, bwd


def kind_tables(plan_tables: Sequence[PlanTable], local_world: int) -> list[KindTable]:
    """The plan's tables of non-fused kinds as :class:`KindTable`."""
    out = []
    for t in plan_tables:
        kind = t.kind
        if kind in V1_KINDS:
            continue
        shards = t.shards
        host_dims: dict[int, int] = {}
        if kind in HOST_KINDS:
            seen: set[tuple[int, int]] = set()
            for s in shards:
                key = (host_of(s.rank, local_world), s.col_offset)
                if key not in seen:
                    seen.add(key)
                    host_dims[key[0]] = host_dims.get(key[0], 0) + s.cols
        out.append(
            KindTable(
                kind=kind,
                dim=t.dim,
                rows=t.rows,
                dtype=t.dtype,
                ranks=tuple(sorted({s.rank for s in shards})),
                host_dims=host_dims,
            )
        )
    return out


def default_links(world: int, hosts: int) -> HostLinks:
    """The presets a job of ``world`` GPUs on ``hosts`` hosts most likely has."""
    return host_links(default_preset(world), hosts)
