"""What the tables of the splitting kinds hold on each rank: a search state's *base*.

A table the search puts row-wise, table-row-wise or data-parallel has no placement
freedom (:func:`~shardwise.planner.oversized.kind_shards`: TorchRec's even row cut over
every rank or one host's, or a copy on every rank). So it adds a fixed vector per rank:
memory, its own kernels (one per kind group and precision, apart from the fused one,
at the global batch or, data-parallel, the rank's own), and its collectives. The fused
shards are placed around it. A state writes such a table as one negative *code* in
place of its column widths (:func:`kind_code`), so states stay plain tuples that the
beam can hash and compare; :func:`kinds_of` reads the choices back.

A base is priced exactly as :meth:`CostPredictor.predict_plan` prices those tables
(the same kernels and collectives), memoized by the choices, so a search's price of a
state and the predictor's price of its plan agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shardwise.planner.comm.collectives import plan_kind_parts
from shardwise.planner.costmodel import CostPredictor
from shardwise.planner.kinds import FUSED_GROUP, KindOption
from shardwise.planner.oversized import kind_shards
from shardwise.planner.plan import Plan
from shardwise.planner.tables import TableSpec
from shardwise.planner.topology import Topology

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: A state's kind choices: ``(table index, option)`` of its tables not fused, by index.
Kinds = tuple[tuple[int, KindOption], ...]

_ROW, _DP, _HOST = -1, -2, -3  # codes; table-row-wise on host h is _HOST - h


def kind_code(option: KindOption) -> tuple[int, ...]:
    """The one-entry "widths" that stand for ``option`` in a state."""
    if option.kind == "row_wise":
        return (_ROW,)
    if option.kind == "data_parallel":
        return (_DP,)
    if option.kind == "table_row_wise":
        return (_HOST - option.host,)
    raise ValueError(f"{option.kind} is placed by the search's widths, not coded")


def option_of(widths: tuple[int, ...]) -> KindOption | None:
    """The kind a state's entry codes, or None for column widths (fused)."""
    if not widths or widths[0] > 0:
        return None
    code = widths[0]
    if code == _ROW:
        return KindOption("row_wise")
    if code == _DP:
        return KindOption("data_parallel")
    return KindOption("table_row_wise", _HOST - code)


def kinds_of(state: Sequence[tuple[int, ...]]) -> Kinds:
    return tuple((t, opt) for t, w in enumerate(state) if (opt := option_of(w)) is not None)


@dataclass(frozen=True)
class Base:
    """Per rank: bytes ``[W]``, compute ``[W, 2]`` and collectives ``[W, 2]`` (fwd, bwd)
    of the coded tables, and for the risk rule the seconds their kernels take ``[W]``
    and those seconds times each kernel's log spread ``[W]`` (zeros without a rank head)."""

    kinds: Kinds
    mem: I64
    compute: F64
    comm: F64
    seconds: F64
    spread: F64

    @staticmethod
    def empty(world: int) -> Base:
        z = np.zeros(world)
        return Base(
            (), np.zeros(world, dtype=np.int64), np.zeros((world, 2)), np.zeros((world, 2)), z, z
        )


def kinds_plan(
    tables: Sequence[TableSpec], kinds: Kinds, topology: Topology, name: str = "kinds"
) -> Plan:
    """The coded tables alone as a plan (what prices them)."""
    specs = [tables[t] for t, _ in kinds]
    return Plan.from_shards(
        specs,
        [kind_shards(opt, tables[t], topology) for t, opt in kinds],
        topology,
        name,
        kinds=[opt.kind for _, opt in kinds],
    )


def price_base(
    tables: Sequence[TableSpec], kinds: Kinds, topology: Topology, predictor: CostPredictor
) -> Base:
    """:class:`Base` of ``kinds`` as :meth:`CostPredictor.predict_plan` prices them."""
    world, batch = topology.gpus, topology.batch_size_per_rank
    if not kinds:
        return Base.empty(world)
    part = kinds_plan(tables, kinds, topology)
    specs = [tables[t] for t, _ in kinds]
    mem = np.asarray(part.memory_per_rank(specs), dtype=np.int64)
    compute, _ = predictor.plan_kernels(part, specs, batch)
    parts = plan_kind_parts(part, predictor.comm_model, batch)
    fwd = np.sum([c.fwd for c in parts], axis=0) if parts else np.zeros(world)
    bwd = np.sum([c.bwd for c in parts], axis=0) if parts else np.zeros(world)
    seconds = compute.sum(axis=1)
    spread = np.zeros(world)
    if predictor.anchored_head is not None:
        # Each kernel group's spread, weighted by its seconds (the risk rule's input).
        per_rank = part.kernel_shards(specs)
        for local in (False, True):
            sets = [
                [
                    (k.spec, k.cols)
                    for k in shards
                    if k.local_batch == local and k.group != FUSED_GROUP
                ]
                for shards in per_rank
            ]
            if not any(sets):
                continue
            b = batch if local else batch * world
            secs = predictor.compute(sets, b).sum(axis=1)
            spread += predictor.rank_sigmas(sets, b) * secs
    return Base(kinds, mem, compute, np.stack([fwd, bwd], axis=1), seconds, spread)
