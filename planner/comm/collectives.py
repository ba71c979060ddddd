"""The collectives besides the pooled all-to-all, by sharding kind (docs/comm.md).

Table-wise and column-wise shards send their pooled outputs through one all-to-all
(:class:`~shardwise.planner.comm.model.CommModel`). The other kinds
(:mod:`shardwise.planner.kinds`) add their own collectives, batched over the tables of
each kind as TorchRec 1.8 batches them (``rw_sharding.RwPooledEmbeddingDist``,
``twrw_sharding.TwRwPooledEmbeddingDist``, ``dist_data.PooledEmbeddingsReduceScatter``,
``comm_ops.ReduceScatterBase_Req``). With ``B`` samples a rank, ``W = L × H`` ranks
(``L`` a host), outputs fp32:

- **row-wise**: every rank holds a partial pooled output ``[W·B, D]`` (``D`` the summed
  widths of every row-wise table) and ``reduce_scatter_tensor`` sums it into each
  rank's ``[B, D]`` (forward); its backward is ``all_gather_into_tensor`` of the
  gradients, the same bytes. A ring moves ``(W-1)/W`` of the ``W·B·D·4``-byte input
  per rank; across hosts NCCL's rings (one per NIC) cut that into a ring within the
  host, ``(L-1)/L`` of it, and one between hosts of the host's ``1/L`` share,
  ``(H-1)/H`` of it: ``(H-1)·B·D·4`` bytes a rank over the NIC;
- **table-row-wise** and **grid**: the reduce-scatter runs within each host only
  (``intra_pg``), over host ``h``'s tables, width ``D_h``: ``(L-1)·H·B·D_h·4`` bytes a
  rank; then an all-to-all between the ranks of one local rank on every host
  (``cross_pg``) sends each other host its ``B`` samples, ``(H-1)·B·D_h·4`` bytes; the
  backward runs both in reverse;
- **data-parallel**: no forward exchange; DDP all-reduces the tables' gradients
  (``rows × dim`` in the weights' dtype) in the backward: a ring moves ``2(W-1)/W`` of
  them a rank, across hosts a reduce-scatter within, an all-reduce of the ``1/L`` share
  between, and an all-gather within.

Every level costs one α of its link. A collective ends together, so each costs all of
its ranks its time; the one within host ``h`` costs only that host's ranks. The ids'
all-to-all is left out for every kind, as it is for the pooled all-to-all. Links come
from the comm model (:func:`host_links`); fitted collectives (a comm dataset's, or a
cost model's learned ones, :mod:`.learned`) replace them on one host, where they were
measured, and price the level within each host of a job spanning several; the level
between hosts stays the link's, labelled modelled (no host here can measure it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shardwise.planner.comm.hosts import (
    HOST_PRESETS,
    HostPreset,
    comm_local_world,
    default_preset,
    hosts_of,
)
from shardwise.planner.comm.learned import LearnedCollective, model_collectives
from shardwise.planner.comm.model import (
    OUTPUT_BYTES,
    PRESETS,
    AlphaBetaComm,
    CommModel,
    LearnedComm,
    ring_bytes,
)
from shardwise.planner.kinds import HOST_KINDS, V1_KINDS, host_of
from shardwise.planner.plan import Plan, PlanTable
from shardwise.planner.tables import DTYPE_BYTES

Array = npt.NDArray[np.float64]

#: The parts a plan's comm is reported in, in this order (``CommPart.name``).
ALL_TO_ALL = "all-to-all"
ROW_WISE = "row-wise reduce-scatter/all-gather"
HOST_ROW_WISE = "table-row-wise/grid reduce-scatter within hosts + all-to-all between"
DATA_PARALLEL = "data-parallel gradient all-reduce"


@dataclass(frozen=True)
class HostLinks:
    """The link within a host and the link between hosts, as α–β models; ``origin``
    says what gave them; ``fitted`` holds collectives fitted on one host of the
    target (``reduce_scatter``, ``all_reduce``: a comm dataset's, ``fitted:DIR``) and
    ``learned`` a cost model's (a line a world size, :mod:`.learned`), used in place of
    ``intra`` there and, for the reduce-scatter, within each host of a job spanning
    several."""

    intra: AlphaBetaComm
    inter: AlphaBetaComm
    origin: str = ""
    fitted: Mapping[str, AlphaBetaComm] = field(default_factory=dict)
    learned: Mapping[str, LearnedCollective] = field(default_factory=dict)

    def fit(self, name: str, world: int) -> AlphaBetaComm | None:
        """The fitted ``name`` collective over ``world`` ranks of one host: a learned
        one's line for that size, else the comm dataset's fit; None without either."""
        learned = self.learned.get(name)
        return learned.link(world) if learned is not None else self.fitted.get(name)

    def _fit_phrase(self, name: str, world: int) -> str | None:
        learned = self.learned.get(name)
        if learned is not None:
            return f"the {learned.what} {learned.phrase(world)}"
        fit = self.fitted.get(name)
        return None if fit is None else fit.summary()

    def describe(self, hosts: int, collective: str | None = None, local_world: int = 0) -> str:
        """What prices a part over ``hosts`` hosts of ``local_world`` ranks: the links,
        or the fit of ``collective`` where it is used: on one host ``learned`` where a
        cost model's fit rests on honest measurements at that size
        (:meth:`~.learned.LearnedCollective.label`), else ``modelled``; across hosts
        always ``modelled``: the fitted reduce-scatter within, the link between."""
        name = collective or ""
        if hosts <= 1 and name in self.learned:
            return self.learned[name].label(local_world)
        if hosts <= 1 and name in self.fitted:
            return f"modelled: {self.fitted[name].summary()}"
        within = self._fit_phrase("reduce_scatter", local_world) if local_world != 1 else None
        if hosts > 1 and within is not None:
            by = f" (from {self.origin})" if self.origin else ""
            return f"modelled: within a host {within}; between hosts {self.inter.short()}{by}"
        if hosts <= 1:
            line = f"{self.intra.short()} within the host"
        else:
            line = f"{self.intra.short()} within a host, {self.inter.short()} between hosts"
        return f"modelled by {self.origin}: {line}" if self.origin else f"modelled: {line}"


def host_links(comm: CommModel, hosts: int, world: int | None = None) -> HostLinks:
    """The links a job's collectives are priced on: a host preset's two; a flat α–β
    model for both on one host, and across hosts as the link between them with NVLink
    within; for a learned or measured all-to-all, the default preset for the job's
    size (``world``), or the ``hgx-h100`` host preset across hosts, said so. Fitted
    collectives (``fitted:DIR``'s, a cost model's learned ones) come along for the
    collectives within a host."""
    if isinstance(comm, HostPreset):
        return HostLinks(comm.intra, comm.inter, f"the {comm.name} host preset")
    if isinstance(comm, AlphaBetaComm):
        fitted = dict(comm.collectives)
        what = f"the {comm.name} preset" if comm.name in PRESETS else comm.name
        if hosts <= 1:
            return HostLinks(comm, comm, what, fitted)
        return HostLinks(PRESETS["nvlink"], comm, what, fitted)
    fallback = host_links(
        default_preset(world or 1) if hosts <= 1 else HOST_PRESETS["hgx-h100"], hosts
    )
    learned = model_collectives(comm) if isinstance(comm, LearnedComm) else {}
    return HostLinks(
        fallback.intra,
        fallback.inter,
        f"{fallback.origin}, for want of a measurement or fit of them",
        {},
        learned,
    )


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


@dataclass(frozen=True)
class CommPart:
    """One part of a plan's comm: per-rank (fwd, bwd) seconds ``[W]`` and what priced
    it (``measured: …``, ``modelled by …``, ``learned: …``)."""

    name: str
    fwd: Array
    bwd: Array
    priced_by: str

    def to_json(self) -> dict[str, object]:
        return {
            "part": self.name,
            "priced_by": self.priced_by,
            "fwd_s": self.fwd.tolist(),
            "bwd_s": self.bwd.tolist(),
        }


# ------------------------------------------------------------------ α–β by level


def _t(link: AlphaBetaComm, moved: float) -> float:
    return link.alpha_s + moved / link.bytes_per_s


def reduce_scatter_s(size: float, local_world: int, hosts: int, links: HostLinks) -> float:
    """A reduce-scatter (or its all-gather) of ``size`` input bytes a rank over
    ``hosts × local_world`` ranks: within the host, then between hosts on the host's
    ``1/L`` share (module docstring)."""
    if size <= 0 or local_world * hosts < 2:
        return 0.0
    t = 0.0
    if local_world > 1:
        within = links.fit("reduce_scatter", local_world) or links.intra
        t += _t(within, ring_bytes("reduce_scatter", size, local_world))
    if hosts > 1:
        t += _t(links.inter, ring_bytes("reduce_scatter", size / local_world, hosts))
    return t


def all_reduce_s(size: float, local_world: int, hosts: int, links: HostLinks) -> float:
    """An all-reduce of ``size`` bytes: one ring on one host; across hosts a
    reduce-scatter within, an all-reduce of the share between, an all-gather within."""
    if size <= 0 or local_world * hosts < 2:
        return 0.0
    if hosts == 1:
        link = links.fit("all_reduce", local_world) or links.intra
        return _t(link, ring_bytes("all_reduce", size, local_world))
    t = _t(links.inter, ring_bytes("all_reduce", size / local_world, hosts))
    if local_world > 1:
        within = links.fit("reduce_scatter", local_world) or links.intra
        t += 2 * _t(within, ring_bytes("reduce_scatter", size, local_world))
    return t


# ------------------------------------------------------------------ by kind


def kind_sizes(
    tables: Sequence[KindTable], world: int, local_world: int, batch_size_per_rank: int
) -> dict[str, float]:
    """The collectives' sizes in bytes: ``row_wise`` (the reduce-scatter's input a
    rank), ``host_row_wise`` (the largest host's), ``data_parallel`` (the gradients)."""
    row = world * batch_size_per_rank * OUTPUT_BYTES
    hosts = hosts_of(world, local_world)
    per_host = np.zeros(hosts)
    for t in tables:
        if t.kind in HOST_KINDS:
            for h, d in t.host_dims.items():
                per_host[h] += d
    return {
        "row_wise": row * sum(t.dim for t in tables if t.kind == "row_wise"),
        "host_row_wise": row * float(per_host.max(initial=0.0)),
        "data_parallel": float(
            sum(t.rows * t.dim * DTYPE_BYTES[t.dtype] for t in tables if t.kind == "data_parallel")
        ),
    }


def kind_parts(
    tables: Sequence[KindTable],
    world: int,
    local_world: int,
    batch_size_per_rank: int,
    links: HostLinks,
) -> list[CommPart]:
    """Each kind's collectives (module docstring) as a :class:`CommPart`, for the kinds
    the tables hold; none on one rank."""
    parts: list[CommPart] = []
    if world < 2 or not tables:
        return parts
    hosts = hosts_of(world, local_world)
    local_world = min(local_world, world)
    sizes = kind_sizes(tables, world, local_world, batch_size_per_rank)
    ones = np.ones(world)
    if any(t.kind == "row_wise" for t in tables):
        t_rs = reduce_scatter_s(sizes["row_wise"], local_world, hosts, links)
        priced = links.describe(hosts, "reduce_scatter", local_world)
        parts.append(CommPart(ROW_WISE, t_rs * ones, t_rs * ones, priced))
    host_tables = [t for t in tables if t.kind in HOST_KINDS]
    if host_tables:
        per_host = np.zeros(hosts)
        for t in host_tables:
            for h, d in t.host_dims.items():
                per_host[h] += d
        row = world * batch_size_per_rank * OUTPUT_BYTES
        # Within each host the fitted reduce-scatter where there is one (one host's
        # measurement); between hosts the link alone, labelled modelled.
        within = np.array([reduce_scatter_s(row * d, local_world, 1, links) for d in per_host])
        cost = within[np.arange(world) // local_world]
        if hosts > 1:
            cross = links.inter.alpha_s + (
                (hosts - 1) * batch_size_per_rank * OUTPUT_BYTES * float(per_host.max())
            ) / (links.inter.bytes_per_s)
            cost = cost + cross
        priced = links.describe(hosts, "reduce_scatter", local_world)
        parts.append(CommPart(HOST_ROW_WISE, cost.copy(), cost.copy(), priced))
    if any(t.kind == "data_parallel" for t in tables):
        t_ar = all_reduce_s(sizes["data_parallel"], local_world, hosts, links)
        priced = links.describe(hosts, "all_reduce", local_world)
        parts.append(CommPart(DATA_PARALLEL, np.zeros(world), t_ar * ones, priced))
    return parts


def kind_comm(
    tables: Sequence[KindTable],
    world: int,
    local_world: int,
    batch_size_per_rank: int,
    links: HostLinks,
) -> tuple[Array, Array]:
    """Per-rank (fwd, bwd) seconds ``[W]`` of every collective the tables' kinds add:
    the sum of :func:`kind_parts`."""
    fwd = np.zeros(world)
    bwd = np.zeros(world)
    for part in kind_parts(tables, world, local_world, batch_size_per_rank, links):
        fwd += part.fwd
        bwd += part.bwd
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


def plan_kind_parts(plan: Plan, comm: CommModel, batch_size_per_rank: int) -> list[CommPart]:
    """The other kinds' collectives of ``plan`` as ``comm`` prices them: on its hosts
    (:func:`~shardwise.planner.comm.hosts.comm_local_world`) and links
    (:func:`host_links`). What the predictor and the evaluator's declared comm add to
    the all-to-all, so both price a plan alike."""
    world = plan.world_size
    local_world = comm_local_world(comm, plan.topology)
    hosts = hosts_of(world, local_world)
    links = host_links(comm, hosts, world)
    tables = kind_tables(plan.tables, local_world)
    return kind_parts(tables, world, local_world, batch_size_per_rank, links)


def fused_dims(plan: Plan) -> list[int]:
    """Each rank's pooled all-to-all width: the summed columns of its table-wise and
    column-wise shards (the other kinds send through their own collectives)."""
    return [
        sum(s.cols for t, s in shards if t.kind in V1_KINDS) for shards in plan.shards_per_rank()
    ]


def describe_parts(first: str, parts: Sequence[CommPart]) -> str:
    """The comm line: the all-to-all's ``describe()``, then each other part and what
    priced it. A plan of table-wise and column-wise tables alone keeps the bare line."""
    if not parts:
        return first
    rest = "; ".join(f"{p.name}: {p.priced_by}" for p in parts)
    return f"{ALL_TO_ALL}: {first}; {rest}"


def default_links(world: int, hosts: int) -> HostLinks:
    """The presets a job of ``world`` GPUs on ``hosts`` hosts most likely has."""
    return host_links(default_preset(world), hosts, world)
